"""Stain-shift dose-response cohort: the same tissue rendered at several shift severities.

A severity ``s`` places a site on the straight line, in stain-and-scanner parameter space, from one
client site (the anchor) to the external site: ``s = 0`` is the anchor's stain chemistry and scanner,
``s = 1`` is the external site exactly, ``s = 0.5`` is half way, and ``s = 2`` continues in the same
direction twice as far as the external site lies from the anchor. Every :class:`SiteStyle` field
moves linearly; fields that would leave their physical range when extrapolated are clamped.

The cohort is a paired design: each tissue (class, H/E concentration maps, differentiation,
magnification) is drawn once, and every severity renders it with the same slide-level jitter draw and
the same sensor-noise draw. Between severities only stain chemistry and scanner differ, so a change in
accuracy along the severity axis is the shift's effect, not a different sample of tissue.
"""

from __future__ import annotations

# ``shift`` below is the dose-response experiment's settings block (experiments.dose_response.DoseResponseConfig);
# typed Any so this renderer, which that module imports inside its step, imports nothing of it back.
import dataclasses
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from fedhisto import CLASSES
from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config, SyntheticCohort
from fedhisto.infra.atomic import write_bytes, write_csv
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.synth.embedded_cohort import (
    BASE_EDGE,
    LH_DIFF,
    LH_PREFIX,
    MAGNIFICATION_SCALE,
    _parallel_map,
    _rng,
    external_grades,
)
from fedhisto.synth.relatives import encode_jpeg
from fedhisto.synth.stain_styles import SiteStyle, render_rgb, style_at
from fedhisto.synth.tissue import tissue

STAGE = "experiments"
#: First entry of every seed stream drawn here after the shift seed. The cohort's streams are
#: ``[cohort.seed, 0|1|2, key]`` and the pretraining pool's ``[pretrain.seed, 99, c, k]``: a different
#: tag and length keep the shifted tissues disjoint from both even if the seeds happened to coincide.
STREAM_TAG = 15
COLUMNS = ("sample_id", "tissue_id", "severity", "relpath", "path", "label", "differentiation", "magnification")


def severity_tag(severity: float) -> str:
    return f"s{severity:g}"


@dataclass(frozen=True)
class ShiftTissue:
    """One tissue of the shifted cohort, rendered at every severity."""

    label: str
    class_index: int
    index: int              # within its class
    differentiation: str
    magnification: str

    @property
    def tissue_id(self) -> str:
        # LungHist700-shaped, as the external cohort; the number is unique within the class
        parts = [LH_PREFIX[self.label], *([LH_DIFF[self.differentiation]] if self.differentiation else []),
                 self.magnification, str(self.index + 1)]
        return "_".join(parts)


def plan_shift(shift: Any) -> list[ShiftTissue]:
    """The shifted cohort's tissues, with the external cohort's differentiation / magnification mix."""
    rng = _rng(shift.seed, STREAM_TAG, 0)
    return [ShiftTissue(cls, c, k, diff, mag)
            for c, cls in enumerate(CLASSES)
            for k, (diff, mag) in enumerate(external_grades(cls, shift.images_per_class, rng))]


def tissue_maps(t: ShiftTissue, seed: int, edge: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Hematoxylin and eosin concentration maps of tissue ``t`` and its render scale."""
    scale = edge / BASE_EDGE * MAGNIFICATION_SCALE[t.magnification]
    h, e = tissue(t.label, _rng(seed, STREAM_TAG, 1, t.class_index, t.index), edge, scale, t.differentiation)
    return h, e, scale


def slide_style(base: SiteStyle, t: ShiftTissue, seed: int) -> tuple[SiteStyle, np.random.Generator]:
    """``base`` with the tissue's slide-level jitter, and the generator then positioned at its noise draw.

    A fresh generator from the same stream for every severity gives every severity the same jitter
    draw and the same standard-normal noise field (scaled by the severity's noise level).
    """
    rng = _rng(seed, STREAM_TAG, 2, t.class_index, t.index)
    return base.jittered(rng), rng


def render_styles(t: ShiftTissue, seed: int, edge: int, styles: Sequence[SiteStyle]) -> list[tuple[np.ndarray, SiteStyle]]:
    """RGB of tissue ``t`` under each base style (same maps, jitter and noise draw), with the jittered style."""
    h, e, scale = tissue_maps(t, seed, edge)
    out = []
    for base in styles:
        style, rng = slide_style(base, t, seed)
        out.append((render_rgb(h, e, style, rng, scale), style))
    return out


def _render_job(args: tuple[ShiftTissue, int, int, tuple[float, ...], tuple[SiteStyle, ...], str]) -> list[dict]:
    t, seed, edge, severities, styles, images_dir = args
    rows = []
    for sev, (rgb, style) in zip(severities, render_styles(t, seed, edge, styles), strict=True):
        relpath = f"{severity_tag(sev)}/{t.tissue_id}.jpg"
        path = Path(images_dir) / relpath
        write_bytes(path, encode_jpeg(Image.fromarray(rgb), style.jpeg_quality))
        rows.append({"sample_id": f"{severity_tag(sev)}_{t.tissue_id}", "tissue_id": t.tissue_id,
                     "severity": float(sev), "relpath": relpath, "path": path.as_posix(), "label": t.label,
                     "differentiation": t.differentiation, "magnification": t.magnification})
    return rows


def render_shift_cohort(cohort: SyntheticCohort, shift: Any, out_dir: Path,
                        threads: int = 1) -> list[dict]:
    """Render every tissue at every severity under ``out_dir/images/s<severity>/``; rows severity-major.

    ``relpath`` is relative to ``out_dir/images`` (as the cohort's sources), ``path`` absolute.
    """
    severities = tuple(float(s) for s in shift.severities)
    tags = [severity_tag(s) for s in severities]
    if len(set(tags)) != len(tags):  # two severities in one folder would overwrite each other's images
        raise ValueError(f"severities {list(severities)} do not have distinct folder names {tags}")
    styles = tuple(style_at(s, shift.anchor_site) for s in severities)
    images_dir = (Path(out_dir) / "images").resolve()
    tissues = plan_shift(shift)
    jobs = [(t, shift.seed, cohort.external_image_size, severities, styles, str(images_dir)) for t in tissues]
    per_tissue = _parallel_map(_render_job, jobs, threads, "shift")
    return [rows[i] for i in range(len(severities)) for rows in per_tissue]


def contact_sheet(rows: list[dict], severities: Sequence[float], per_class: int = 2, tile: int = 128) -> Image.Image:
    """Rows = the first ``per_class`` tissues of each class, columns = severities (as written to disk)."""
    by_key = {(r["tissue_id"], r["severity"]): r for r in rows}
    tissues = []
    for cls in CLASSES:
        ids = list(dict.fromkeys(r["tissue_id"] for r in rows if r["label"] == cls))
        tissues += ids[:per_class]
    left, top, pad = 96, 18, 2
    sheet = Image.new("RGB", (left + len(severities) * (tile + pad), top + len(tissues) * (tile + pad)), "white")
    draw = ImageDraw.Draw(sheet)
    for j, sev in enumerate(severities):
        draw.text((left + j * (tile + pad) + 4, 3), f"severity {sev:g}", fill="black")
    for i, tid in enumerate(tissues):
        y = top + i * (tile + pad)
        draw.text((4, y + tile // 2 - 6), tid, fill="black")
        for j, sev in enumerate(severities):
            with Image.open(by_key[(tid, float(sev))]["path"]) as img:
                sheet.paste(img.convert("RGB").resize((tile, tile), Image.Resampling.BILINEAR),
                            (left + j * (tile + pad), y))
    return sheet


def style_record(style: SiteStyle) -> dict:
    return {k: (tuple(round(float(x), 4) for x in v) if isinstance(v, tuple) else round(float(v), 4)
                if isinstance(v, float) else v) for k, v in dataclasses.asdict(style).items()}


def run_render_shift(cfg: Config, out_dir: str | Path, threads: int = 1) -> dict:
    """Render the shifted cohort, write ``cohort.csv`` (with provenance sidecar) and ``contact_sheet.png``."""
    out = Path(out_dir)
    shift = cfg.experiments.dose_response
    start = time.perf_counter()
    rows = render_shift_cohort(cfg.cohort.synthetic, shift, out, threads)
    seconds = time.perf_counter() - start
    csv_path = out / "cohort.csv"
    write_csv(csv_path, rows, COLUMNS)
    write_sidecar(csv_path, provenance_block(STAGE, stage_block(cfg, "shift_cohort")))
    buf = io.BytesIO()
    contact_sheet(rows, shift.severities).save(buf, format="PNG", optimize=False)
    write_bytes(out / "contact_sheet.png", buf.getvalue())
    return {"images": len(rows), "tissues": len(rows) // len(shift.severities), "render_seconds": round(seconds, 2),
            "seconds_per_image": round(seconds / max(len(rows), 1), 4),
            "images_per_severity": {severity_tag(s): sum(r["severity"] == s for r in rows) for s in shift.severities},
            "styles": {severity_tag(s): style_record(style_at(s, shift.anchor_site)) for s in shift.severities},
            "anchor_site": shift.anchor_site}
