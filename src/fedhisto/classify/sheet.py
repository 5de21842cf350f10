"""A contact sheet: a sample of classified images with their label and confidence, for a person to look at
before trusting the table. Up to ``per_class`` images per predicted class, evenly spaced through that
class's rows in file order (deterministic); uncertain rows are marked with '?', out-of-domain ones with '!'."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fedhisto import CLASSES
from fedhisto.infra.atomic import write_with
from fedhisto.infra.imageio import load_rgb

THUMB = 128
CAPTION = 28


def pick(rows: list[dict], per_class: int) -> list[dict]:
    chosen = []
    for cls in CLASSES:
        of = [r for r in rows if r["label"] == cls]
        if of:
            idx = np.unique(np.linspace(0, len(of) - 1, min(per_class, len(of))).round().astype(int))
            chosen += [of[i] for i in idx]
    return chosen


def contact_sheet(rows: list[dict], folder: Path, path: Path, per_class: int = 8) -> int:
    """Write the PNG; returns the number of images shown. ``rows``: the classification rows."""
    chosen = pick(rows, per_class)
    cols = max(1, min(per_class, max(len(chosen), 1)))
    n_rows = max(1, -(-len(chosen) // cols))
    sheet = Image.new("RGB", (cols * THUMB, n_rows * (THUMB + CAPTION)), "white")
    draw = ImageDraw.Draw(sheet)
    for k, r in enumerate(chosen):
        x, y = (k % cols) * THUMB, (k // cols) * (THUMB + CAPTION)
        thumb = Image.fromarray(load_rgb(folder / r["image"]))
        thumb.thumbnail((THUMB, THUMB))
        sheet.paste(thumb, (x + (THUMB - thumb.width) // 2, y + (THUMB - thumb.height) // 2))
        mark = (" ?" if r["uncertain"] == "yes" else "") + (" !" if r.get("in_domain") == "no" else "")
        draw.text((x + 2, y + THUMB + 1), f"{r['label']} {float(r['confidence']):.2f}{mark}", fill="black")
        draw.text((x + 2, y + THUMB + 14), Path(r["image"]).name[:20], fill="gray")
    write_with(path, lambda tmp: sheet.save(tmp, format="PNG"))
    return len(chosen)
