"""Loader families of the encoder registry: how a ``transformers`` or a ``timm`` backbone is built,
run, saved, and how its hub checkpoints' key layouts map onto the built module.

Everything model-specific comes from the registry entry (``fedhisto.registries.encoder_registry``); a family only
knows its library. Both import their library lazily: timm (and with it torchvision) is needed only
when a timm entry is used (``pip install "fedhisto[zoo]"``).
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedhisto.registries.encoder_registry import EncoderEntry


class EncoderLoadError(RuntimeError):
    """The encoder could not be loaded as configured (names the folder, file or tensor)."""


def _read_config(folder: Path) -> dict[str, Any] | None:
    path = folder / "config.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EncoderLoadError(f"{path}: not valid JSON ({exc})") from None


def _mismatches(found: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    out = []
    for key, want in expected.items():
        if key not in found or isinstance(want, str):
            continue
        got = found[key]
        same = abs(float(got) - float(want)) < 1e-4 if isinstance(want, float) and isinstance(got, int | float) else got == want
        if not same:
            out.append(f"{key}={got!r} (expected {want!r})")
    return out


# ------------------------------------------------------------------ transformers
#: wrapper prefixes of hub checkpoints (custom code, task heads) and the modules' own top-level names
_HF_PREFIXES = ("dinov2.", "vit.", "model.", "backbone.", "encoder_model.")
_HF_TOP_LEVEL = ("embeddings.", "encoder.", "layers.", "layernorm.", "pooler.")
#: older transformers releases and the HIBOU repository name tensors differently from the installed release
_HF_RENAMES = [
    (r"\.attention\.attention\.query\.", ".attention.q_proj."),
    (r"\.attention\.attention\.key\.", ".attention.k_proj."),
    (r"\.attention\.attention\.value\.", ".attention.v_proj."),
    (r"\.attention\.output\.dense\.", ".attention.o_proj."),
    (r"\.mlp\.weights_out\.", ".mlp.down_proj."),
]
#: ViTModel (Phikon) additionally flattened encoder.layer and renamed its MLP in transformers 5
_HF_CLASS_RENAMES = {
    "ViTModel": [(r"^encoder\.layer\.", "layers."), (r"\.intermediate\.dense\.", ".mlp.fc1."),
                 (r"\.output\.dense\.", ".mlp.fc2.")],
}
_HF_MODEL_TYPES = {"Dinov2WithRegistersModel": {"dinov2_with_registers", "dinov2"},  # HIBOU's hub config says dinov2
                   "Dinov2Model": {"dinov2"}, "ViTModel": {"vit"}}
_KNOWN_HF_TYPES = {"dinov2_with_registers", "dinov2", "vit"}


class TransformersFamily:
    name = "transformers"

    @staticmethod
    def build(entry: EncoderEntry, depth: int | None = None) -> nn.Module:
        import transformers

        model_cls = getattr(transformers, entry.architecture)
        config_cls = getattr(transformers, entry.architecture.removesuffix("Model") + "Config")
        kwargs = dict(entry.kwargs)
        if depth is not None:
            kwargs["num_hidden_layers"] = depth
        extra = {"add_pooling_layer": False} if entry.architecture == "ViTModel" else {}
        return model_cls(config_cls(**kwargs), **extra)

    @staticmethod
    def tokens(entry: EncoderEntry, module: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """Final-layernormed tokens (B, prefix + patches, width). For the DINOv2 classes the CLS row is
        exactly their ``pooler_output``."""
        extra = {"interpolate_pos_encoding": True} if entry.architecture == "ViTModel" else {}
        return module(pixel_values=pixels, **extra).last_hidden_state

    @staticmethod
    def translate(entry: EncoderEntry, state: dict[str, torch.Tensor], target: set[str]) -> dict[str, torch.Tensor]:
        renames = _HF_RENAMES + _HF_CLASS_RENAMES.get(entry.architecture, [])
        out: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            while not key.startswith(_HF_TOP_LEVEL) and key.startswith(_HF_PREFIXES):
                key = key.split(".", 1)[1]
            if key in target:
                out[key] = value
            elif ".mlp.weights_in." in key:  # fused SwiGLU input: first half gates, second half is the value path
                gate, up = value.chunk(2, dim=0)
                out[key.replace(".mlp.weights_in.", ".mlp.gate_proj.")] = gate
                out[key.replace(".mlp.weights_in.", ".mlp.up_proj.")] = up
            else:
                for pattern, repl in renames:
                    key = re.sub(pattern, repl, key)
                out[key] = value
        return out

    @staticmethod
    def check_folder(entry: EncoderEntry, folder: Path, depth: int | None = None) -> None:
        found = _read_config(folder)
        where = folder / "config.json"
        if found is None:
            raise EncoderLoadError(f"{where} not found: not a model folder")
        if "architecture" in found and "model_type" not in found:
            raise EncoderLoadError(f"{where}: a timm folder (architecture {found['architecture']!r}), "
                                   f"not {entry.name}'s transformers {entry.architecture}")
        model_type = found.get("model_type")
        if model_type in _KNOWN_HF_TYPES and model_type not in _HF_MODEL_TYPES[entry.architecture]:
            raise EncoderLoadError(f"{where}: model_type {model_type!r} is not {entry.name}'s "
                                   f"{entry.architecture} ({' or '.join(sorted(_HF_MODEL_TYPES[entry.architecture]))})")
        wrong = _mismatches(found, {**entry.kwargs, **({"num_hidden_layers": depth} if depth else {})})
        if wrong:
            raise EncoderLoadError(f"{where}: not a {entry.name} encoder: {', '.join(wrong)}")

    @staticmethod
    def save(entry: EncoderEntry, module: nn.Module, folder: Path) -> None:
        module.save_pretrained(folder)


# -------------------------------------------------------------------------- timm
_TIMM_PREFIXES = ("module.", "model.", "backbone.", "teacher.", "student.", "trunk.", "timm_model.", "encoder.")
_TIMM_TOP_LEVEL = ("cls_token", "reg_token", "pos_embed", "mask_token", "patch_embed.", "blocks.", "norm.",
                   "norm_pre.", "fc_norm.", "head.", "attn_pool.")


def _resolve(value: Any) -> Any:
    """Registry kwargs stay torch-free: ``"timm.layers.SwiGLUPacked"`` names the class."""
    if isinstance(value, str) and value.startswith(("timm.", "torch.")):
        module_name, _, attr = value.rpartition(".")
        return getattr(importlib.import_module(module_name), attr)
    return value


def _import_timm():
    try:
        import timm
    except ImportError as exc:
        raise EncoderLoadError("timm encoders need the zoo extra: install a torch build with its matching "
                               "torchvision, then `pip install \"fedhisto[zoo]\"` (README: the zoo lane); "
                               f"import failed: {exc}") from None
    return timm


class TimmFamily:
    name = "timm"

    @staticmethod
    def build(entry: EncoderEntry, depth: int | None = None) -> nn.Module:
        timm = _import_timm()
        kwargs = {k: _resolve(v) for k, v in entry.kwargs.items()}
        if depth is not None:
            kwargs["depth"] = depth
        return timm.create_model(entry.architecture, pretrained=False, **kwargs)

    @staticmethod
    def tokens(entry: EncoderEntry, module: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """global_pool "" makes timm's forward return the final-normed tokens (B, prefix + patches, width)."""
        out = module(pixels)
        if out.ndim != 3:
            raise RuntimeError(f"{entry.name}: timm forward returned shape {tuple(out.shape)}, expected tokens "
                               "(batch, tokens, width); the entry must set global_pool=''")
        return out

    @staticmethod
    def translate(entry: EncoderEntry, state: dict[str, torch.Tensor], target: set[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            while not key.startswith(_TIMM_TOP_LEVEL) and key.startswith(_TIMM_PREFIXES):
                key = key.split(".", 1)[1]
            out[key] = value
        return out

    @staticmethod
    def check_folder(entry: EncoderEntry, folder: Path, depth: int | None = None) -> None:
        """A timm hub snapshot has config.json (architecture, model_args); a bare checkpoint folder may not,
        and then only the strict tensor check guards it."""
        found = _read_config(folder)
        if found is None:
            return
        where = folder / "config.json"
        if "model_type" in found:
            raise EncoderLoadError(f"{where}: a transformers folder (model_type {found['model_type']!r}), "
                                   f"not {entry.name}'s timm {entry.architecture}")
        arch = found.get("architecture")
        if arch is not None and arch != entry.architecture:
            raise EncoderLoadError(f"{where}: architecture {arch!r} is not {entry.name}'s {entry.architecture!r}")
        wrong = _mismatches(found.get("model_args", {}), {**entry.kwargs, **({"depth": depth} if depth else {})})
        if wrong:
            raise EncoderLoadError(f"{where}: not a {entry.name} encoder: {', '.join(wrong)}")

    @staticmethod
    def save(entry: EncoderEntry, module: nn.Module, folder: Path) -> None:
        """The layout of a timm hub snapshot: model.safetensors plus config.json with the architecture."""
        from safetensors.torch import save_file

        from fedhisto.infra.atomic import write_json, write_with

        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
        write_with(folder / "model.safetensors", lambda tmp: save_file(state, str(tmp)))
        args = dict(entry.kwargs)
        if len(module.blocks) != entry.depth:  # a reduced-depth build (tests) says so
            args["depth"] = len(module.blocks)
        write_json(folder / "config.json", {"architecture": entry.architecture, "num_classes": 0,
                                            "num_features": entry.width, "model_args": args,
                                            "fedhisto_encoder": entry.name})


FAMILIES = {"transformers": TransformersFamily, "timm": TimmFamily}
