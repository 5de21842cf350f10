"""Bad input: unreadable files stop with their name, readable odd formats convert correctly."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedhisto.infra.imageio import UnreadableImageError, load_rgb


def _jpeg_bytes(seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("name", "payload"),
    [("empty.jpg", b""), ("truncated.jpg", _jpeg_bytes()[:700]), ("text.png", b"not an image at all\n")],
)
def test_unreadable_files_raise_naming_the_file(tmp_path: Path, name: str, payload: bytes):
    path = tmp_path / name
    path.write_bytes(payload)
    with pytest.raises(UnreadableImageError, match=name.replace(".", r"\.")):
        load_rgb(path)


def test_missing_file_is_named(tmp_path: Path):
    with pytest.raises(UnreadableImageError, match=r"image not found: .*nope\.png"):
        load_rgb(tmp_path / "nope.png")


def test_cmyk_converts_to_rgb(tmp_path: Path):
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "c.jpg", "JPEG", quality=100)
    rgb = load_rgb(tmp_path / "c.jpg")
    assert rgb.shape == (8, 8, 3) and rgb.dtype == np.uint8
    assert rgb[..., 0].mean() > 200 and rgb[..., 1].mean() < 60  # pure red survives


def test_16_bit_png_is_rescaled_not_clipped(tmp_path: Path):
    arr = np.array([[0, 32768, 65535]], dtype=np.uint16)
    img = Image.fromarray(arr)
    assert img.mode == "I;16"
    img.save(tmp_path / "g16.png")
    rgb = load_rgb(tmp_path / "g16.png")
    assert rgb[0, :, 0].tolist() == [0, 128, 255]
    assert (rgb[..., 0] == rgb[..., 2]).all()


def test_rgba_is_composited_on_white(tmp_path: Path):
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)   # opaque red
    rgba[0, 1] = (255, 0, 0, 0)     # fully transparent -> white background
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    rgb = load_rgb(tmp_path / "a.png")
    assert rgb[0, 0].tolist() == [255, 0, 0]
    assert rgb[0, 1].tolist() == [255, 255, 255]


def test_palette_and_grey_convert(tmp_path: Path):
    Image.new("L", (4, 4), 77).save(tmp_path / "l.png")
    Image.new("RGB", (4, 4), (10, 200, 30)).convert("P").save(tmp_path / "p.png")
    assert load_rgb(tmp_path / "l.png")[0, 0].tolist() == [77, 77, 77]
    assert load_rgb(tmp_path / "p.png").shape == (4, 4, 3)
