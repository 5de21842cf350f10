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

#: set by a Snakemake job (``fedhisto.entry.from_snakemake``) to the GPUs its rule declares (resource ``gpu``)
JOB_GPUS = "FEDHISTO_JOB_GPUS"


class DeviceUnavailable(RuntimeError):
    """The run was told to use a GPU (``train.device: cuda``, or a job that declares one) and none is usable."""


def declared_gpus() -> int:
    """The GPUs this job declares: its Snakemake rule's ``gpu`` resource (authoritative when set, 0 too: a
    CPU rule inside a GPU allocation declares none), else what SLURM allotted a job submitted by hand."""
    for name in (JOB_GPUS, "SLURM_GPUS_ON_NODE"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def cuda_unavailable_cause() -> str | None:
    """Why this process cannot use a CUDA GPU (the torch build, the visible devices, the driver), or None."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"torch {torch.__version__} is built without CUDA (a CPU-only wheel); install a CUDA build of "
                "torch (pytorch.org, 'Get started') into this environment")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return (f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from this process (did the scheduler give "
                "the job a GPU?)")
    try:
        torch.cuda.init()  # raises with the driver's own reason
    except Exception as exc:  # any failure to initialise CUDA is the cause reported
        return (f"CUDA does not initialise with torch {torch.__version__} (built for CUDA {torch.version.cuda}): "
                f"{str(exc).strip().splitlines()[0]} (no NVIDIA driver, or one older than the build needs)")
    return f"torch finds no CUDA device ({torch.cuda.device_count()} visible)"


def pick_device(cfg: Config | None = None) -> torch.device:
    """The device of a torch stage, from ``train.device`` (``auto`` without a config): ``cpu``; ``cuda``,
    which must be usable; ``auto``, CUDA when usable, else the CPU, except in a job that declares a GPU
    (``declared_gpus``), which stops naming the cause instead of running for hours on one CPU thread.
    The GPU is the one the environment exposes (CUDA_VISIBLE_DEVICES, as SLURM sets it); never assumes
    cuda:0 exists. Turns deterministic algorithms on first (``set_determinism``)."""
    return device_for(cfg.train.device if cfg is not None else "auto")


def device_for(choice: str) -> torch.device:
    """``pick_device`` for a ``train.device`` value (``fedhisto classify --device``)."""
    set_determinism()
    if choice not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device {choice!r}: allowed auto, cuda, cpu")
    if choice == "cpu":
        return torch.device("cpu")
    cause = cuda_unavailable_cause()
    if cause is None:
        return torch.device("cuda")
    if choice == "cuda":
        raise DeviceUnavailable(f"train.device is cuda, but {cause}. Set train.device: cpu to run on the CPU.")
    gpus = declared_gpus()
    if gpus:
        raise DeviceUnavailable(f"this job declares {gpus} GPU(s) (Snakemake resource gpu, or SLURM's allocation) "
                                f"but no GPU is usable: {cause}. To run it on the CPU on purpose (hours for a "
                                "foundation model), set train.device: cpu.")
    return torch.device("cpu")


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
