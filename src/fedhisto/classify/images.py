"""A new site's image folder: every file either classified or listed as an exclusion with its reason.

- a file whose suffix is not an image format (``IMAGE_SUFFIXES``), or a hidden file: excluded, listed;
- an image larger than ``max_megapixels`` (read from its header, before decoding): excluded with its size.
  The model sees a tile shrunk to twice its input edge, so a whole-slide-sized file is not something to
  classify as one tile: cut it into tiles first;
- an undecodable or truncated file: excluded, with the decoder's message;
- greyscale, 16-bit, RGBA / palette-with-transparency and CMYK images are converted to 8-bit RGB by
  ``fedhisto.infra.imageio.load_rgb`` (16-bit rescaled, transparency composited on white) and the row says so.

Decoding is the pipeline's own (``splits.load_for_eval``), so the pixels the model sees are those of the
``predict`` stage for the same file.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from fedhisto.data.splits import load_for_eval
from fedhisto.infra.imageio import UnreadableImageError
from fedhisto.infra.progress import Progress

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
CONVERSIONS = {"L": "greyscale -> RGB", "LA": "greyscale+alpha composited on white -> RGB",
               "RGBA": "RGBA composited on white -> RGB", "P": "palette -> RGB", "PA": "palette+alpha -> RGB",
               "CMYK": "CMYK -> RGB", "YCbCr": "YCbCr -> RGB", "I;16": "16-bit rescaled to 8-bit RGB",
               "I;16B": "16-bit rescaled to 8-bit RGB", "I;16L": "16-bit rescaled to 8-bit RGB",
               "I": "32-bit integer rescaled to 8-bit RGB", "F": "32-bit float rescaled to 8-bit RGB",
               "1": "1-bit -> RGB"}


class ImageFolderError(RuntimeError):
    pass


@dataclass
class Decoded:
    relpaths: list[str] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)
    converted: list[str] = field(default_factory=list)
    exclusions: list[dict] = field(default_factory=list)


def header(path: Path) -> tuple[str, tuple[int, int]]:
    """Mode and (width, height) from the header only (no pixel is decoded). PIL's decompression-bomb
    guard is ours to apply here (``max_megapixels``), with the size in the message."""
    limit = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = None
        with warnings.catch_warnings(), Image.open(path) as img:
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return img.mode, img.size
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def decode_folder(folder: str | Path, max_edge: int, max_megapixels: float) -> Decoded:
    folder = Path(folder)
    if not folder.is_dir():
        raise ImageFolderError(f"--images {folder}: not a folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise ImageFolderError(f"--images {folder}: the folder is empty; nothing to classify")
    out = Decoded()
    with Progress(len(files), "classify: decode images", "file") as bar:
        for p in files:
            rel = p.relative_to(folder).as_posix()
            bar.update()
            if any(part.startswith(".") for part in p.relative_to(folder).parts):
                out.exclusions.append({"image": rel, "reason": "hidden file"})
                continue
            if p.suffix.lower() not in IMAGE_SUFFIXES:
                out.exclusions.append({"image": rel, "reason": f"not an image (suffix {p.suffix or 'none'!r}; "
                                                               f"read: {', '.join(IMAGE_SUFFIXES)})"})
                continue
            try:
                mode, (w, h) = header(p)
            except Exception as exc:
                out.exclusions.append({"image": rel, "reason": f"unreadable image ({type(exc).__name__}: {exc})"})
                continue
            if w * h > max_megapixels * 1e6:
                out.exclusions.append({"image": rel, "reason": f"too large: {w} x {h} pixels ({w * h / 1e6:.0f} MP) "
                                                               f"exceeds --max-megapixels {max_megapixels:g}; "
                                                               "cut it into tiles first"})
                continue
            try:
                rgb = load_for_eval(p, max_edge)
            except (UnreadableImageError, MemoryError) as exc:
                out.exclusions.append({"image": rel, "reason": str(exc)})
                continue
            out.relpaths.append(rel)
            out.paths.append(p)
            out.images.append(rgb)
            out.converted.append("" if mode == "RGB" else CONVERSIONS.get(mode, f"{mode} -> RGB"))
    if not out.images:
        reasons = "; ".join(f"{e['image']}: {e['reason']}" for e in out.exclusions[:5])
        raise ImageFolderError(f"--images {folder}: no classifiable image among {len(files)} file(s) ({reasons})")
    return out
