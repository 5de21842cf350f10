"""Every entry of the encoder registry, table-driven, on randomly initialised models of the exact
architecture (no download). transformers entries run in the main lane; timm entries need
fedhisto[zoo] and run under ``-m zoo`` (README: the zoo lane).

Adding an encoder: one entry in ``fedhisto.registries.encoder_registry`` plus its row in ``ROWS``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fedhisto.config.study import EncoderConfig, ModelConfig, load_config
from fedhisto.infra.settings_base import ConfigError
from fedhisto.model.encoder import EncoderLoadError, load_encoder, load_encoder_folder, random_encoder
from fedhisto.model.parameter_card import meta_model
from fedhisto.registries.encoder_registry import ENCODERS, encoder_entry

# name: (LoRA modules, LoRA parameters at the study's r = 8 on query/key/value/attention_output, embedding dim).
# transformers: q, k, v, o per block, each D -> D: modules 4 L, parameters L * 4 * r (D + D) = 64 D L.
# timm: fused qkv (D -> 3D) and proj (D -> D) per block: modules 2 L, parameters L * r (4D + 2D) = 48 D L.
ROWS = {
    "tiny": (12, 64 * 64 * 3, 64),
    "hibou-b": (48, 64 * 768 * 12, 768),
    "hibou-l": (96, 64 * 1024 * 24, 1024),
    "phikon": (48, 64 * 768 * 12, 768),
    "phikon-v2": (96, 64 * 1024 * 24, 1024),
    "uni": (48, 48 * 1024 * 24, 1024),
    "uni2-h": (48, 48 * 1536 * 24, 1536),
    "virchow2": (64, 48 * 1280 * 32, 2560),  # CLS + mean patch token: twice the width
    "h-optimus-0": (80, 48 * 1536 * 40, 1536),
    "h-optimus-1": (80, 48 * 1536 * 40, 1536),
    "prov-gigapath": (80, 48 * 1536 * 40, 1536),
}
#: a folder of this other entry must be refused by the row's entry (different architecture)
WRONG = {"tiny": "phikon", "hibou-b": "tiny", "hibou-l": "hibou-b", "phikon": "tiny", "phikon-v2": "hibou-l",
         "uni": "virchow2", "uni2-h": "uni", "virchow2": "uni2-h", "h-optimus-0": "prov-gigapath",
         "h-optimus-1": "uni", "prov-gigapath": "h-optimus-0"}
REDUCED_DEPTH = 2  # forwards and round trips of every entry run at two blocks: the count uses the full depth

ZOO = pytest.mark.zoo


def _rows(names=ROWS):
    return [pytest.param(n, marks=ZOO) if ENCODERS[n].family == "timm" else n for n in names]


def _figure(text: str) -> tuple[float, float]:
    """'1.1B' -> (1.1e9, 1e8): the value and one unit of its last stated digit."""
    number, suffix = re.fullmatch(r"([\d.]+)([MB])", text).groups()
    scale = {"M": 1e6, "B": 1e9}[suffix]
    decimals = len(number.split(".")[1]) if "." in number else 0
    return float(number) * scale, scale / 10 ** decimals


def test_every_entry_has_a_test_row():
    assert set(ROWS) == set(ENCODERS) == set(WRONG)


def test_registry_and_config_import_without_torch():
    """The Snakefile reads the registry at parse time: importing it must not import torch."""
    code = ("import sys, fedhisto.registries.encoder_registry, fedhisto.config.study; "
            "sys.exit(int(any(m in sys.modules for m in ('torch', 'transformers', 'timm'))))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("name", _rows())
def test_parameter_count_is_the_published_one(name: str):
    entry = encoder_entry(name)
    with torch.device("meta"):
        module = random_encoder(name).module
    assert sum(p.numel() for p in module.parameters()) == entry.parameters
    if entry.published_figure is not None:
        value, unit = _figure(entry.published_figure)
        assert abs(entry.parameters - value) <= unit, f"{name}: {entry.parameters:,} vs published {entry.published}"
        assert entry.published.startswith(entry.published_figure)


@pytest.mark.parametrize("name", _rows())
def test_lora_attaches_to_exactly_the_named_targets(name: str):
    entry = encoder_entry(name)
    modules, lora_params, _dim = ROWS[name]
    model = meta_model(name, "past_v2")
    targets = sorted(n.removesuffix(".lora_A") for n, _ in model.encoder.named_modules() if n.endswith(".lora_A"))
    suffixes = {s for t in ("query", "key", "value", "attention_output") for s in entry.lora_suffixes[t]}
    assert len(targets) == modules
    assert all(t.endswith(tuple(suffixes)) for t in targets)
    assert not any("patch_embed" in t or "embeddings" in t for t in targets)
    blocks = model.encoder_blocks()
    assert len(blocks) == entry.depth
    assert sum(p.numel() for n, p in model.encoder.named_parameters() if "lora_" in n) == lora_params


@pytest.mark.parametrize("name", _rows())
def test_model_card_offline(name: str, capsys):
    from fedhisto.cli import main

    assert main(["model-card", "--encoder", name, "--method", "past_v2"]) == 0
    card = json.loads(capsys.readouterr().out)
    _modules, lora_params, dim = ROWS[name]
    assert card["backbone_parameters"] == ENCODERS[name].parameters
    assert card["lora_parameters"] == lora_params
    # adapter dim -> 256 -> dim with LayerNorm, FiLM 14 -> 64 -> 2 dim, classifier dim -> 3 (study shapes)
    assert card["adapter_parameters"] == 2 * dim + dim * 256 + 256 + 256 * dim + dim
    assert card["film_parameters"] == 14 * 64 + 64 + 64 * 2 * dim + 2 * dim
    assert card["classifier_parameters"] == 3 * dim + 3


@pytest.mark.parametrize("name", _rows())
def test_forward_gives_the_declared_dim_at_the_declared_size(name: str):
    entry = encoder_entry(name)
    torch.manual_seed(0)
    encoder = random_encoder(name, depth=REDUCED_DEPTH)
    encoder.module.eval()
    x = torch.rand(2, 3, entry.input_size, entry.input_size)
    with torch.no_grad():
        tokens = encoder.tokens(x)
        z = encoder.embed(x)
    assert tokens.shape == (2, entry.prefix_tokens + (entry.input_size // entry.patch_size) ** 2, entry.width)
    assert z.shape == (2, ROWS[name][2]) == (2, entry.dim)
    assert torch.equal(z[:, :entry.width], tokens[:, 0])
    if entry.pooling == "cls+mean_patch":  # registers excluded from the mean
        assert torch.allclose(z[:, entry.width:], tokens[:, entry.prefix_tokens:].mean(1))


@pytest.mark.parametrize("name", _rows())
def test_save_load_round_trip_is_strict(name: str, tmp_path: Path):
    torch.manual_seed(1)
    saved = random_encoder(name, depth=REDUCED_DEPTH)
    saved.save(tmp_path / "enc")
    loaded = load_encoder_folder(tmp_path / "enc", name, depth=REDUCED_DEPTH)
    a, b = saved.module.state_dict(), loaded.module.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _hf_legacy(state: dict[str, torch.Tensor], architecture: str) -> dict[str, torch.Tensor]:
    """The hub's (older transformers / custom code) key layout of a transformers state dict."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if ".mlp.up_proj." in k:
            continue
        if ".mlp.gate_proj." in k:  # HIBOU's fused SwiGLU input
            out[k.replace(".mlp.gate_proj.", ".mlp.weights_in.")] = torch.cat([v, state[k.replace("gate", "up")]])
            continue
        k = re.sub(r"\.attention\.([qkv])_proj\.", lambda m: ".attention.attention." + {"q": "query", "k": "key",
                   "v": "value"}[m.group(1)] + ".", k)
        k = k.replace(".attention.o_proj.", ".attention.output.dense.").replace(".mlp.down_proj.", ".mlp.weights_out.")
        if architecture == "ViTModel":
            k = re.sub(r"^layers\.", "encoder.layer.", k)
            k = k.replace(".mlp.fc1.", ".intermediate.dense.").replace(".mlp.fc2.", ".output.dense.")
        out[k] = v
    if architecture == "ViTModel":  # Phikon's hub checkpoint carries ViTModel's pooler, which the entry ignores
        width = state["layernorm.weight"].shape[0]
        out["pooler.dense.weight"], out["pooler.dense.bias"] = torch.zeros(width, width), torch.zeros(width)
    return out


@pytest.mark.parametrize("name", _rows())
def test_checkpoint_in_the_hub_layout_loads(name: str, tmp_path: Path):
    from safetensors.torch import save_file

    entry = encoder_entry(name)
    torch.manual_seed(2)
    saved = random_encoder(name, depth=REDUCED_DEPTH)
    saved.save(tmp_path / "hub")
    state = saved.module.state_dict()
    if entry.family == "transformers":
        (tmp_path / "hub/model.safetensors").unlink()
        hub = {("dinov2." if "Dinov2" in entry.architecture else "") + k: v.contiguous()
               for k, v in _hf_legacy(state, entry.architecture).items()}
        assert set(hub) != set(state)  # the layout really differs
        save_file(hub, str(tmp_path / "hub/model.safetensors"))
    else:  # timm hub repos: the timm state dict as pytorch_model.bin beside timm's config.json
        (tmp_path / "hub/model.safetensors").unlink()
        torch.save(state, tmp_path / "hub/pytorch_model.bin")
        cfg = json.loads((tmp_path / "hub/config.json").read_text())
        cfg["pretrained_cfg"] = {"mean": list(entry.mean), "std": list(entry.std), "num_classes": 0}
        (tmp_path / "hub/config.json").write_text(json.dumps(cfg))
        # and a bare checkpoint saved from a DDP-wrapped model (module. prefix), no config.json
        (tmp_path / "bare").mkdir()
        torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "bare/pytorch_model.bin")
        bare = load_encoder_folder(tmp_path / "bare", name, depth=REDUCED_DEPTH)
        assert all(torch.equal(bare.module.state_dict()[k], v) for k, v in state.items())
    loaded = load_encoder_folder(tmp_path / "hub", name, depth=REDUCED_DEPTH)
    x = torch.rand(1, 3, entry.input_size, entry.input_size)
    saved.module.eval()
    with torch.no_grad():
        assert torch.allclose(saved.embed(x), loaded.embed(x), atol=1e-5)


@pytest.mark.parametrize("name", _rows())
def test_folder_of_another_architecture_names_the_mismatch(name: str, tmp_path: Path):
    other = WRONG[name]
    if ENCODERS[other].family == "timm" or ENCODERS[name].family == "timm":
        pytest.importorskip("timm")
    random_encoder(other, depth=REDUCED_DEPTH).save(tmp_path / other)
    with pytest.raises(EncoderLoadError) as info:
        load_encoder_folder(tmp_path / other, name, depth=REDUCED_DEPTH)
    message = str(info.value)
    assert str(tmp_path / other) in message
    assert re.search(r"not a .* encoder: |is not .*'s|a (timm|transformers) folder", message), message
    if ENCODERS[name].family == "timm" and ENCODERS[other].family == "timm":
        # without config.json only the tensors can tell: the error names them
        (tmp_path / other / "config.json").unlink()
        with pytest.raises(EncoderLoadError, match=r"(does not fit .*missing|tensor shapes differ from)"):
            load_encoder_folder(tmp_path / other, name, depth=REDUCED_DEPTH)


def test_unknown_encoder_lists_the_known_ones():
    with pytest.raises(KeyError, match="known encoders: tiny, hibou-b, hibou-l, phikon"):
        encoder_entry("resnet50")
    with pytest.raises(ConfigError, match=r"model\.encoder\.name.*'uni'.*'virchow2'.*'prov-gigapath'"):
        load_config({"model": {"encoder": {"name": "resnet50"}}})


@pytest.mark.parametrize("name", [n for n, e in ENCODERS.items() if e.gated])
def test_gated_model_without_a_folder_says_how_to_provide_one(name: str):
    """No revision is pinned for these, so the loader stops before any network access."""
    with pytest.raises(EncoderLoadError, match=rf"{re.escape(ENCODERS[name].hub_id)} is gated: accept its terms"
                                               r".*huggingface-cli download.*model\.encoder\.local_dir"):
        load_encoder(EncoderConfig(name=name))


def test_hub_entries_fill_repo_and_revision_and_keep_old_defaults():
    assert EncoderConfig(name="uni").repo_id == "MahmoodLab/UNI" and EncoderConfig(name="uni").revision is None
    assert EncoderConfig(name="uni", revision="abc").revision == "abc"
    study, tiny = EncoderConfig(), EncoderConfig(name="tiny")
    assert study.repo_id == tiny.repo_id == "histai/hibou-b"  # the tiny encoder's run identity stays as it was
    assert study.revision == tiny.revision == ENCODERS["hibou-b"].revision


def test_normalisation_option():
    default = load_config({"model": {"encoder": {"name": "hibou-b"}}})
    assert default.views.mean == (0.485, 0.456, 0.406)  # the study's ImageNet statistics (section 3.4)
    from fedhisto.config.stage_blocks import stage_block
    from fedhisto.infra.settings_base import identity_dump

    assert "normalisation" not in identity_dump(default.views)  # IF_CHANGED: so no stage block changes
    assert "normalisation" not in stage_block(default, "train", method="past_v2", seed=11)["views"]
    own = load_config({"views": {"normalisation": "encoder"}, "model": {"encoder": {"name": "hibou-b"}}})
    assert own.views.mean == (0.7068, 0.5755, 0.722) and own.views.std == (0.195, 0.2316, 0.1816)
    assert identity_dump(own.views)["normalisation"] == "encoder"
    with pytest.raises(ConfigError, match=r"views\.mean is set too"):
        load_config({"views": {"normalisation": "encoder", "mean": [0.5, 0.5, 0.5]}})


def test_fused_qkv_refuses_a_partial_query_key_value_target():
    pytest.importorskip("timm")
    with pytest.raises(ValueError, match=r"fused attn\.qkv"), torch.device("meta"):
        meta_model("uni", "past_v2", ModelConfig(lora_targets=["query", "value"]))


def test_pretraining_is_refused_for_foundation_models():
    with pytest.raises(ConfigError, match="only applies to the tiny encoder; uni is loaded pretrained"):
        load_config({"model": {"encoder": {"name": "uni"}, "pretrain": {"enabled": True}}})


@ZOO
def test_snakemake_plans_the_full_pipeline_for_a_uni_folder(tmp_path: Path, repo: Path, snakemake_bin: str):
    from conftest import write_tiny_config

    random_encoder("uni", depth=REDUCED_DEPTH).save(tmp_path / "uni")
    wd = tmp_path / "wd"
    path = write_tiny_config(wd)
    cfg = yaml.safe_load(path.read_text())
    cfg["model"]["pretrain"]["enabled"] = False  # a foundation model arrives pretrained
    path.write_text(yaml.safe_dump(cfg))
    override = f"model={{encoder: {{name: uni, local_dir: {tmp_path / 'uni'}}}}}"  # the README's spelling
    proc = subprocess.run([snakemake_bin, "-s", str(repo / "Snakefile"), "-d", str(wd), "-n", "--quiet", "rules",
                           "all", "--config", override], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    for rule in ("synthesize_cohort", "audit_duplicates", "build_manifest", "compute_stain_descriptors",
                 "train_federated", "predict_cohorts", "summarize_metrics", "bootstrap_comparison"):
        assert rule in text, rule
    assert "pretrain_encoder" not in text  # UNI arrives pretrained
