"""A run's model, device and the digests of what it is conditioned on (run identity)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from fedhisto.config.study import Config
from fedhisto.infra.provenance import canonical_json, config_hash, digest_path
from fedhisto.model.encoder import load_encoder
from fedhisto.model.peft_model import FedHistoModel


def pick_device() -> torch.device:
    """From the environment (CUDA_VISIBLE_DEVICES as SLURM sets it); never assumes cuda:0 exists.
    Turns deterministic algorithms on first (``set_determinism``)."""
    set_determinism()
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def set_determinism() -> None:
    """Deterministic kernels wherever torch has them (cuDNN deterministic, no autotuning, as the study
    says). On CUDA, cuBLAS needs a fixed workspace for reproducible matmuls; an op without a
    deterministic kernel warns rather than stops a study-scale run (the warning lands in the rule log)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def build_model(cfg: Config, method: Any, seed: int, encoder_dir: str | None, encoder: Any = None) -> FedHistoModel:
    """``method``: the run's method (``methods.strategy.Strategy``: its ``film`` decides the FiLM module). ``encoder``:
    an already loaded ``FrozenEncoder`` of this config and folder (a site worker's copy, loaded once per
    node) used instead of loading it again; LoRA is injected into it, so pass a copy."""
    torch.manual_seed(0)  # a random (non-pretrained) encoder must be identical across runs
    if encoder is None:
        encoder = load_encoder(cfg.model.encoder, encoder_dir)
    torch.manual_seed(seed)  # LoRA A and head initialisation follow the run seed
    return FedHistoModel(encoder, cfg.model, film=method.film)


def descriptor_digest(descriptors: dict[str, torch.Tensor | None]) -> str:
    """SHA-256 of the descriptor values a run conditions on (``none`` for a method without FiLM)."""
    if all(v is None for v in descriptors.values()):
        return "none"
    values = {k: None if v is None else [float(x) for x in v.tolist()] for k, v in sorted(descriptors.items())}
    return hashlib.sha256(canonical_json(values).encode()).hexdigest()


def encoder_digest(cfg: Config, encoder_dir: str | None) -> str:
    """The frozen encoder's weights: the files of a local folder (pipeline-pretrained or downloaded),
    else the hub id and pinned revision (or the random-initialisation recipe) that fix them."""
    folder = encoder_dir or cfg.model.encoder.local_dir
    if folder:
        return digest_path(folder)
    return config_hash(cfg.model.encoder.model_dump(mode="json"))
