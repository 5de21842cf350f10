"""The frozen encoder at run time: any entry of the registry (``fedhisto.registries.encoder_registry``).

``FrozenEncoder`` is the one interface the rest of the code uses: ``embed(pixels) -> (B, dim)``
pooled as the entry says, ``blocks()`` (FedStain restyles after block k), ``dim``, and the full
module names LoRA attaches to. The backbone itself (``.module``) is a plain transformers or timm
module, so checkpoints keep the library's own tensor names.

Loading is strict, from a local folder (``save_pretrained`` output or a hub snapshot) or the pinned
hub revision's snapshot in the local Hugging Face cache (``local_snapshot``: never downloaded by a
job; ``model.snapshot`` fetches it once): the checkpoint's keys are mapped from the hub's layout onto the
built module (``families``), and a missing or surplus tensor, a wrong shape or a folder of another architecture is an ``EncoderLoadError``
naming the folder and the tensor, never a silent random initialisation.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fedhisto.config.study import EncoderConfig
from fedhisto.model.encoder_families import FAMILIES, EncoderLoadError
from fedhisto.registries.encoder_registry import ENCODERS, EncoderEntry, encoder_entry

__all__ = ["ENCODERS", "EncoderLoadError", "FrozenEncoder", "load_encoder", "load_encoder_folder", "random_encoder"]

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
#: what a hub snapshot needs: the config and the weights (either format)
HUB_FILES = ["*.json", "*.safetensors", "*.bin"]


def pooled_embedding(entry: EncoderEntry, module: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """(B, entry.dim): the CLS token, or CLS concatenated with the mean patch token (registers excluded)."""
    tokens = FAMILIES[entry.family].tokens(entry, module, pixels)
    cls = tokens[:, 0]
    if entry.pooling == "cls":
        return cls
    return torch.cat([cls, tokens[:, entry.prefix_tokens:].mean(dim=1)], dim=-1)


def encoder_blocks(entry: EncoderEntry, module: nn.Module) -> list[nn.Module]:
    """The transformer blocks in order, reached through the entry's ``blocks_path``."""
    current = module
    for part in entry.blocks_path.split("."):
        current = getattr(current, part)
    return list(current)


def lora_module_names(entry: EncoderEntry, module: nn.Module, targets: list[str]) -> list[str]:
    """Full names of the modules LoRA attaches to for the paper's target names (query/key/value/
    attention_output), as the entry spells them for its library."""
    unknown = [t for t in targets if t not in entry.lora_suffixes]
    if unknown:
        raise ValueError(f"unknown LoRA target {unknown[0]!r}; allowed: {', '.join(entry.lora_suffixes)}")
    qkv = {"query", "key", "value"}
    if entry.fused_qkv and qkv & set(targets) and not qkv <= set(targets):
        raise ValueError(f"{entry.name}: query, key and value share timm's fused attn.qkv projection, so LoRA "
                         f"adapts all three or none; model.lora_targets lists only {sorted(qkv & set(targets))}")
    names = [n for n, _ in module.named_modules()]
    found: set[str] = set()
    for target in targets:
        hits = [n for n in names if n.endswith(entry.lora_suffixes[target])]
        if not hits:
            raise ValueError(f"LoRA target {target!r} matches no module of the {entry.name} encoder")
        found.update(hits)
    return sorted(found)


class FrozenEncoder:
    """A backbone module with its registry entry."""

    def __init__(self, module: nn.Module, entry: EncoderEntry) -> None:
        self.module = module
        self.entry = entry

    @property
    def dim(self) -> int:
        return self.entry.dim

    def tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        return FAMILIES[self.entry.family].tokens(self.entry, self.module, pixels)

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        return pooled_embedding(self.entry, self.module, pixels)

    def blocks(self) -> list[nn.Module]:
        return encoder_blocks(self.entry, self.module)

    def lora_module_names(self, targets: list[str]) -> list[str]:
        return lora_module_names(self.entry, self.module, targets)

    def save(self, folder: str | Path) -> None:
        """A folder ``load_encoder_folder`` reads back strictly (the family's hub layout)."""
        FAMILIES[self.entry.family].save(self.entry, self.module, Path(folder))

    def parameters(self):
        return self.module.parameters()


def random_encoder(name: str, depth: int | None = None) -> FrozenEncoder:
    """The entry's exact architecture, randomly initialised (``depth`` overrides the block count, for
    forwards of giant models in tests)."""
    entry = encoder_entry(name)
    return FrozenEncoder(FAMILIES[entry.family].build(entry, depth), entry)


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


def _listing(keys: list[str]) -> str:
    return f"{keys[:6]}{'...' if len(keys) > 6 else ''} ({len(keys)})"


def load_encoder_folder(folder: str | Path, name: str, depth: int | None = None) -> FrozenEncoder:
    """Load a local snapshot into the entry's architecture, strictly (``depth``: the entry built with
    fewer blocks, as ``random_encoder``, for round trips of giant models in tests)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise EncoderLoadError(f"encoder folder not found: {folder}")
    entry = encoder_entry(name)
    family = FAMILIES[entry.family]
    family.check_folder(entry, folder, depth)
    encoder = random_encoder(name, depth)
    target = encoder.module.state_dict()
    state = family.translate(entry, _read_weights(folder), set(target))
    state = {k: v for k, v in state.items() if not k.startswith(entry.ignore_keys or ("\0",))}
    missing = sorted(set(target) - set(state))
    unexpected = sorted(set(state) - set(target))
    if missing or unexpected:
        raise EncoderLoadError(f"{folder}: checkpoint does not fit {name} ({entry.architecture}): missing "
                               f"{_listing(missing) if missing else '[]'}, unexpected "
                               f"{_listing(unexpected) if unexpected else '[]'}")
    bad = [f"{k} {tuple(state[k].shape)} (expected {tuple(target[k].shape)})" for k in target
           if tuple(state[k].shape) != tuple(target[k].shape)]
    if bad:
        raise EncoderLoadError(f"{folder}: tensor shapes differ from {name}: {bad[:4]}")
    encoder.module.load_state_dict(state, strict=True)
    return encoder


def fetch_command(config: str | None) -> str:
    return f"fedhisto fetch-encoder --config {config or '<your config>'}"


def local_snapshot(entry: EncoderEntry, repo_id: str, revision: str | None, config: str | None = None) -> Path:
    """The pinned revision's snapshot in the local Hugging Face cache; never downloads."""
    if revision is None:
        raise EncoderLoadError(f"encoder {entry.name!r}: no revision of {repo_id} is pinned ({entry.revision_note}); "
                               f"{entry.get_started()}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=HUB_FILES,
                                      local_files_only=True))
    except Exception as exc:  # not in the cache (or a partial one): say what to run, and where
        from huggingface_hub.constants import HF_HUB_CACHE

        raise EncoderLoadError(
            f"encoder {entry.name!r}: no local snapshot of {repo_id}@{revision} in the Hugging Face cache "
            f"{HF_HUB_CACHE} ({type(exc).__name__}). Jobs never download: run `{fetch_command(config)}` once "
            "where the hub is reachable (a login node), with the same HF_HOME as the jobs, or set "
            "model.encoder.local_dir to a downloaded snapshot") from None


def load_encoder(cfg: EncoderConfig, pretrained_dir: str | Path | None = None) -> FrozenEncoder:
    """The frozen encoder: local folder, pipeline-pretrained tiny encoder, or the pinned hub revision's
    local snapshot (``model.snapshot``: fetched once by ``fedhisto fetch-encoder``; a job never downloads).

    ``pretrained_dir`` is the pipeline's own pretraining output (tiny encoder). With
    ``require_pretrained`` false a random encoder is allowed, only for an entry without a hub
    repository (the tiny one): a hub model is always loaded with its weights.
    """
    entry = encoder_entry(cfg.name)
    folder = cfg.local_dir or pretrained_dir
    if folder is not None:
        encoder = load_encoder_folder(folder, cfg.name)
    elif entry.hub_id is not None:
        encoder = load_encoder_folder(local_snapshot(entry, cfg.repo_id, cfg.revision), cfg.name)
    elif cfg.require_pretrained:
        raise EncoderLoadError(f"encoder '{cfg.name}' requires pretrained weights: set model.encoder.local_dir "
                               "or let the pipeline pretrain it (model.pretrain.enabled)")
    else:
        encoder = random_encoder(cfg.name)
    for p in encoder.module.parameters():
        p.requires_grad_(False)
    encoder.module.eval()
    return encoder
