from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fedhisto.config.study import EncoderConfig, ModelConfig
from fedhisto.model.encoder import (
    EncoderLoadError,
    load_encoder,
    load_encoder_folder,
    random_encoder,
)
from fedhisto.model.parameter_card import model_card
from fedhisto.model.peft_model import FedHistoModel

HIBOU_TOTAL = 86_829_763


@pytest.mark.parametrize(
    ("method", "trainable", "pct"),
    [("past_v2", 1_088_707, 1.253841), ("past_v1", 1_088_707, 1.253841), ("film_zero", 1_088_707, 1.253841),
     ("fedavg_peft", 987_907, 1.137752), ("fedprox_peft", 987_907, 1.137752)],
)
def test_hibou_b_parameter_counts(method: str, trainable: int, pct: float):
    card = model_card("hibou-b", method)
    assert card["backbone_parameters"] == 85_741_056
    assert card["lora_parameters"] == 589_824 and card["lora_modules"] == 48
    assert card["adapter_parameters"] == 395_776
    assert card["classifier_parameters"] == 2_307
    assert card["film_parameters"] == (100_800 if trainable == 1_088_707 else 0)
    assert card["trainable_parameters"] == trainable
    assert card["total_parameters"] == HIBOU_TOTAL
    assert card["trainable_fraction_pct"] == pct


def test_model_card_cli_prints_json(capsys):
    from fedhisto.cli import main

    assert main(["model-card", "--encoder", "hibou-b", "--method", "past_v2"]) == 0
    card = json.loads(capsys.readouterr().out)
    assert card["trainable_parameters"] == 1_088_707


def _save_random(folder: Path, name: str = "tiny", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    encoder = random_encoder(name)
    encoder.save(folder)
    return encoder.module


def test_offline_hub_format_round_trip(tmp_path: Path):
    """A save_pretrained folder of the HIBOU-B family loads through the real loader, weights intact."""
    saved = _save_random(tmp_path / "snap")
    loaded = load_encoder(EncoderConfig(name="tiny", local_dir=str(tmp_path / "snap"))).module
    for (n, a), (_, b) in zip(saved.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert not any(p.requires_grad for p in loaded.parameters())
    x = torch.rand(2, 3, 48, 48)
    saved.eval()
    assert torch.allclose(saved(pixel_values=x).pooler_output, loaded(pixel_values=x).pooler_output)


def _to_legacy_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rewrite a state dict in the older naming (attention.attention.query, fused SwiGLU weights_in)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if ".mlp.gate_proj." in k:
            up = state[k.replace("gate_proj", "up_proj")]
            out["dinov2." + k.replace(".mlp.gate_proj.", ".mlp.weights_in.")] = torch.cat([v, up], 0)
            continue
        if ".mlp.up_proj." in k:
            continue
        k2 = re.sub(r"\.attention\.q_proj\.", ".attention.attention.query.", k)
        k2 = re.sub(r"\.attention\.k_proj\.", ".attention.attention.key.", k2)
        k2 = re.sub(r"\.attention\.v_proj\.", ".attention.attention.value.", k2)
        k2 = re.sub(r"\.attention\.o_proj\.", ".attention.output.dense.", k2)
        k2 = k2.replace(".mlp.down_proj.", ".mlp.weights_out.")
        out["dinov2." + k2] = v
    return out


def test_legacy_checkpoint_names_map_to_the_same_function(tmp_path: Path):
    from safetensors.torch import save_file

    saved = _save_random(tmp_path / "snap", seed=3).eval()
    legacy = _to_legacy_names(saved.state_dict())
    assert any("weights_in" in k for k in legacy)
    (tmp_path / "snap" / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in legacy.items()}, str(tmp_path / "snap" / "model.safetensors"))
    loaded = load_encoder_folder(tmp_path / "snap", "tiny").module
    x = torch.rand(1, 3, 48, 48)
    assert torch.allclose(saved(pixel_values=x).pooler_output, loaded(pixel_values=x).pooler_output, atol=1e-6)


def test_loader_refuses_random_init_and_wrong_shapes(tmp_path: Path):
    with pytest.raises(EncoderLoadError, match="requires pretrained weights"):
        load_encoder(EncoderConfig(name="tiny"))
    _save_random(tmp_path / "snap")
    (tmp_path / "snap" / "model.safetensors").unlink()
    with pytest.raises(EncoderLoadError, match=r"no pretrained weights.*random initialisation is refused"):
        load_encoder_folder(tmp_path / "snap", "tiny")
    _save_random(tmp_path / "tiny")
    with pytest.raises(EncoderLoadError, match=r"not a hibou-b encoder: hidden_size=64 .expected 768."):
        load_encoder_folder(tmp_path / "tiny", "hibou-b")
    with pytest.raises(EncoderLoadError, match="encoder folder not found"):
        load_encoder_folder(tmp_path / "missing", "tiny")


def test_truncated_checkpoint_is_named(tmp_path: Path):
    from safetensors.torch import load_file, save_file

    _save_random(tmp_path / "snap")
    path = tmp_path / "snap" / "model.safetensors"
    state = load_file(str(path))
    state.pop(next(k for k in state if "layernorm" in k))
    save_file(state, str(path))
    with pytest.raises(EncoderLoadError, match="missing \\['layernorm"):
        load_encoder_folder(tmp_path / "snap", "tiny")


def test_exchanged_state_is_trainable_tensors_only():
    torch.manual_seed(0)
    cfg = ModelConfig(adapter_hidden=32)
    model = FedHistoModel(random_encoder("tiny"), cfg, film=True)
    state = model.trainable_state()
    assert all(("lora_" in k) or k.startswith(("adapter.", "film.", "classifier.")) for k in state)
    assert sum(v.numel() for v in state.values()) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    logits, z = model(torch.rand(2, 3, 48, 48), torch.zeros(1, 14))
    assert logits.shape == (2, 3) and z.shape == (2, 64)
    other = FedHistoModel(random_encoder("tiny"), cfg, film=True)
    other.load_trainable_state(state)
    assert all(torch.equal(a, b) for a, b in zip(other.trainable_state().values(), state.values(), strict=True))
    with pytest.raises(ValueError, match="does not fit the model"):
        FedHistoModel(random_encoder("tiny"), cfg, film=False).load_trainable_state(state)


def test_film_starts_as_identity_and_needs_a_descriptor():
    torch.manual_seed(0)
    model = FedHistoModel(random_encoder("tiny"), ModelConfig(adapter_hidden=32), film=True).eval()
    x = torch.rand(1, 3, 48, 48)
    z_zero = model.embed(x, torch.zeros(1, 14))
    z_rand = model.embed(x, torch.randn(1, 14))
    assert torch.allclose(z_zero, z_rand)
    with pytest.raises(ValueError, match="stain descriptor"):
        model.embed(x)


def test_lora_update_orientation_matches_the_paper():
    """peft stores A (r x in) and B (out x r): (alpha / r) B A has the frozen weight's (out x in) shape."""
    model = FedHistoModel(random_encoder("tiny"), ModelConfig(adapter_hidden=32), film=False)
    state = model.trainable_state()
    a_key = next(k for k in state if k.endswith("lora_A.default.weight"))
    a, b = state[a_key], state[a_key.replace("lora_A", "lora_B")]
    assert a.shape == (8, 64) and b.shape == (64, 8)
    assert (b @ a).shape == (64, 64)
