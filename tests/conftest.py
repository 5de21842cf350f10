from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


def write_image(path: Path, seed: int = 0, size: int = 24, fmt: str | None = None, mode: str = "RGB") -> Path:
    """A small random image file (fixture folders stand in for real datasets)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
    img = Image.fromarray(arr)
    if mode != "RGB":
        img = img.convert(mode)
    img.save(path, format=fmt)
    return path


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def snakemake_bin() -> str:
    exe = shutil.which("snakemake")
    if exe is None:
        pytest.fail("snakemake not on PATH: install the package with its dependencies")
    return exe


def write_tiny_config(workdir: Path, max_rounds: int = 2) -> Path:
    """The embedded default shrunk for workflow tests: two methods, one seed, few rounds, a 1-epoch pretrain."""
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["train"].update(methods=["fedavg_peft", "past_v2"], seeds=[11], ablations=[], max_rounds=max_rounds)
    cfg["model"]["pretrain"].update(images_per_class=12, epochs=1)
    path = workdir / "config/config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path
