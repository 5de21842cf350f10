"""Open any listed image as 8-bit RGB, or fail naming the file.

Conversions are explicit rather than left to PIL defaults: 16-bit and 32-bit greyscale are
rescaled (not clipped) to 8 bits, transparency is composited on white (slide background),
CMYK / palette / greyscale go through PIL's colour conversion. A truncated or undecodable
file raises :class:`UnreadableImageError`; nothing is skipped or replaced.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

# Never decode a truncated file into a partially grey image.
ImageFile.LOAD_TRUNCATED_IMAGES = False


class UnreadableImageError(OSError):
    """An image that cannot be decoded completely; the message names the file."""


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") else max(float(arr.max()), 1.0)
        grey = np.clip(np.rint(arr / top * 255.0), 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def load_rgb(path: str | os.PathLike[str]) -> np.ndarray:
    """H x W x 3 uint8 array of the whole image."""
    p = Path(path)
    try:
        with Image.open(p) as img:
            img.load()
            if img.mode == "RGB":
                return np.asarray(img).copy()
            return np.asarray(_to_rgb(img))
    except FileNotFoundError:
        raise UnreadableImageError(f"image not found: {p}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise UnreadableImageError(f"unreadable image: {p} ({type(exc).__name__}: {exc})") from None
