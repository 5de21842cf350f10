"""The frozen encoder as a file in the node's cache, so a restarted site worker loads it instead of rebuilding it.

Rebuilding a frozen encoder means constructing the architecture (random initialisation of every
weight, then thrown away) and reading its weights: the pretrain checkpoint for the pipeline's tiny
encoder, the pinned hub revision for a hub model (a cache lookup, or a download). The file holds the
built encoder's ``state_dict`` exactly; reading it back constructs the architecture on PyTorch's
``meta`` device (no initialisation, no memory) and assigns the file's tensors, so the result is the
rebuilt encoder bit for bit (``tests/test_encoder_cache.py``). An architecture whose construction
keeps state outside its ``state_dict`` (a non-persistent buffer) would be left half on ``meta``: it
is then constructed on the CPU and loaded strictly, still from the file.

Key: SHA-256 of the encoder's config, its digest (``model.build.encoder_digest``: the folder's
files, or the hub id and pinned revision, or the random-initialisation recipe) and the package's
code identity (``code_identity.source_digest``: other code could build another module from the same
weights). The key is stored in the file and compared on read; a file of another key, or one that is
truncated or unreadable, is rebuilt and overwritten. Written atomically (``fedhisto.infra.atomic``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from fedhisto.config.study import Config
from fedhisto.infra.atomic import atomic_path

log = logging.getLogger(__name__)
ENCODER_CACHE_FORMAT = 1


def encoder_cache_key(cfg: Config, encoder_dir: str) -> str:
    from fedhisto.infra.code_identity import code_identity
    from fedhisto.model.build import encoder_digest

    parts = [ENCODER_CACHE_FORMAT, cfg.model.encoder.model_dump(mode="json"), encoder_digest(cfg, encoder_dir or None),
             code_identity()["source_digest"]]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def encoder_cache_file(cache_dir: str | Path, cfg: Config, encoder_dir: str) -> tuple[Path, str]:
    key = encoder_cache_key(cfg, encoder_dir)
    return Path(cache_dir) / f"encoder-{cfg.model.encoder.name}-{key[:20]}.pt", key


def cached_encoder(cache_dir: str | Path, cfg: Config, encoder_dir: str, build: Callable[[], object]):
    """The frozen encoder from ``cache_dir`` if a file of this key is there, else ``build()`` (and the
    file written for the next process)."""
    path, key = encoder_cache_file(cache_dir, cfg, encoder_dir)
    encoder = _read(path, key, cfg.model.encoder.name)
    if encoder is None:
        encoder = build()
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            torch.save({"key": key, "name": cfg.model.encoder.name, "state": encoder.module.state_dict()}, tmp)
    return encoder


def _read(path: Path, key: str, name: str):
    if not path.exists():
        return None
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated or foreign: rebuilt and overwritten by the caller
        log.warning("frozen-encoder cache %s unreadable (%s): building the encoder again", path, exc)
        return None
    if not isinstance(doc, dict) or doc.get("key") != key or doc.get("name") != name:
        log.warning("frozen-encoder cache %s belongs to another encoder or code: building the encoder again", path)
        return None
    try:
        return encoder_from_state(name, doc["state"])
    except Exception as exc:  # a state that does not fit the architecture (it cannot, under a matching key)
        log.warning("frozen-encoder cache %s does not fit %s (%s): building the encoder again", path, name, exc)
        return None


def encoder_from_state(name: str, state: dict[str, torch.Tensor]):
    """The entry's architecture holding exactly ``state`` (strict), frozen and in eval mode."""
    from fedhisto.model.encoder import random_encoder

    try:
        with torch.device("meta"):
            encoder = random_encoder(name)
        encoder.module.load_state_dict(state, strict=True, assign=True)
        if any(t.is_meta for t in (*encoder.module.parameters(), *encoder.module.buffers())):
            raise RuntimeError("state outside the state_dict")
    except Exception as exc:  # construction on meta failed, or left a non-persistent buffer behind
        log.info("encoder %s: not constructible on the meta device (%s); constructing it on the CPU", name, exc)
        encoder = random_encoder(name)
        encoder.module.load_state_dict(state, strict=True)
    for p in encoder.module.parameters():
        p.requires_grad_(False)
    encoder.module.eval()
    return encoder
