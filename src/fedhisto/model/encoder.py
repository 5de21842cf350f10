"""Frozen ViT encoders of the DINOv2-with-registers family.

HIBOU-B (``histai/hibou-b``) has exactly the shape of transformers'
``Dinov2WithRegistersModel`` with hidden 768, 12 layers, 12 heads, patch 14, image 224,
4 register tokens and a SwiGLU FFN (85,741,056 parameters). Its checkpoint is mapped into
that class: key names of the repository's own code and of older transformers releases are
translated to the installed release's names and loaded strictly, so a missing or surplus
tensor is an error, never a silent random initialisation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel

from fedhisto.config import EncoderConfig

#: Architecture of each supported encoder. ``tiny`` is the same family at CPU size.
ENCODER_SHAPES: dict[str, dict] = {
    "hibou-b": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "patch_size": 14,
                "image_size": 224, "num_register_tokens": 4, "use_swiglu_ffn": True, "mlp_ratio": 4},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2, "patch_size": 8,
             "image_size": 48, "num_register_tokens": 4, "use_swiglu_ffn": True, "mlp_ratio": 4},
}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class EncoderLoadError(RuntimeError):
    """The encoder could not be loaded as configured (names the folder, file or tensor)."""


def encoder_config(name: str) -> Dinov2WithRegistersConfig:
    return Dinov2WithRegistersConfig(**ENCODER_SHAPES[name])


def random_encoder(name: str) -> Dinov2WithRegistersModel:
    return Dinov2WithRegistersModel(encoder_config(name))


# Older transformers releases and the HIBOU repository name things differently from the
# installed release; translate to the names the instantiated model uses.
_RENAMES = [
    (r"\.attention\.attention\.query\.", ".attention.q_proj."),
    (r"\.attention\.attention\.key\.", ".attention.k_proj."),
    (r"\.attention\.attention\.value\.", ".attention.v_proj."),
    (r"\.attention\.output\.dense\.", ".attention.o_proj."),
    (r"\.mlp\.weights_out\.", ".mlp.down_proj."),
]
_PREFIXES = ("dinov2.", "model.", "backbone.", "encoder_model.")


_TOP_LEVEL = ("embeddings.", "encoder.", "layernorm.")


def translate_state_dict(state: dict[str, torch.Tensor], target_keys: set[str]) -> dict[str, torch.Tensor]:
    """Map checkpoint keys onto the installed release's names (identity when they already match)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        while not key.startswith(_TOP_LEVEL) and key.startswith(_PREFIXES):
            key = key.split(".", 1)[1]  # wrapper prefixes such as "dinov2." or "model."
        if key in target_keys:
            out[key] = value
        elif ".mlp.weights_in." in key:  # fused SwiGLU input: first half gates, second half is the value path
            gate, up = value.chunk(2, dim=0)
            out[key.replace(".mlp.weights_in.", ".mlp.gate_proj.")] = gate
            out[key.replace(".mlp.weights_in.", ".mlp.up_proj.")] = up
        else:
            for pattern, repl in _RENAMES:
                key = re.sub(pattern, repl, key)
            out[key] = value
    return out


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if path.exists():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)
    raise EncoderLoadError(f"no pretrained weights in {folder} (looked for {', '.join(WEIGHT_FILES)}); "
                           "random initialisation is refused")


def check_shape(folder: Path, name: str) -> None:
    """The folder's config.json must describe the expected architecture."""
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise EncoderLoadError(f"{cfg_path} not found: not a model folder")
    found = json.loads(cfg_path.read_text())
    expected = ENCODER_SHAPES[name]
    wrong = {k: (found.get(k), v) for k, v in expected.items() if k in found and found.get(k) != v}
    if wrong:
        detail = ", ".join(f"{k}={got!r} (expected {want!r})" for k, (got, want) in wrong.items())
        raise EncoderLoadError(f"{cfg_path}: not a {name} encoder: {detail}")


def load_encoder_folder(folder: str | Path, name: str) -> Dinov2WithRegistersModel:
    """Load a local snapshot (``save_pretrained`` output or a hub snapshot) into the target class."""
    folder = Path(folder)
    if not folder.is_dir():
        raise EncoderLoadError(f"encoder folder not found: {folder}")
    check_shape(folder, name)
    model = random_encoder(name)
    target = model.state_dict()
    state = translate_state_dict(_read_weights(folder), set(target))
    missing = sorted(set(target) - set(state))
    unexpected = sorted(set(state) - set(target))
    if missing or unexpected:
        raise EncoderLoadError(f"{folder}: checkpoint does not fit {name}: missing {missing[:6]}"
                               f"{'...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
                               f"{'...' if len(unexpected) > 6 else ''}")
    bad = [k for k in target if tuple(state[k].shape) != tuple(target[k].shape)]
    if bad:
        raise EncoderLoadError(f"{folder}: tensor shapes differ for {bad[:6]}")
    model.load_state_dict(state, strict=True)
    return model


def hub_snapshot(repo_id: str, revision: str) -> Path:
    """Download (or find in the local cache) the pinned revision of a hub repository."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo_id, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except Exception as exc:  # network, auth or missing revision: say which repository and revision
        raise EncoderLoadError(f"cannot fetch {repo_id}@{revision}: {exc}; set model.encoder.local_dir "
                               "to a downloaded snapshot") from exc


def load_encoder(cfg: EncoderConfig, pretrained_dir: str | Path | None = None) -> Dinov2WithRegistersModel:
    """The frozen encoder: local folder, pipeline-pretrained tiny encoder, or pinned hub revision.

    ``pretrained_dir`` is the pipeline's own pretraining output (tiny encoder). With
    ``require_pretrained`` false a random encoder is allowed (never for HIBOU-B).
    """
    folder = cfg.local_dir or pretrained_dir
    if folder is not None:
        model = load_encoder_folder(folder, cfg.name)
    elif cfg.name == "hibou-b":
        model = load_encoder_folder(hub_snapshot(cfg.repo_id, cfg.revision), cfg.name)
    elif cfg.require_pretrained:
        raise EncoderLoadError(f"encoder '{cfg.name}' requires pretrained weights: set model.encoder.local_dir "
                               "or let the pipeline pretrain it")
    else:
        model = random_encoder(cfg.name)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
