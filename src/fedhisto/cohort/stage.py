"""Stage ``cohort``: produce ``results/cohort/sources.csv`` from the embedded synthetic
generator or from real dataset folders, with a contact sheet a person can look at.

The synthetic generator lives in :mod:`fedhisto.synth.embedded_cohort`.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from PIL import Image, ImageDraw

from fedhisto import CLASSES
from fedhisto.config.study import CohortConfig
from fedhisto.infra.atomic import write_json, write_with
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.realdata.listing import sources_inventory
from fedhisto.realdata.sources import SourceRow, collect_sources, write_sources_csv
from fedhisto.synth.embedded_cohort import synthesize, write_planted
from fedhisto.synth.stain_styles import SITE_STYLES

STAGE = "cohort"
log = logging.getLogger(__name__)


def contact_sheet(rows: Sequence[SourceRow], path: Path, per_class: int = 3, tile: int = 112) -> None:
    """A grid, one row per site and ``per_class`` examples per class, labelled for a human reader."""
    sites = list(dict.fromkeys(r.site for r in rows))
    margin, header = 90, 22
    sheet = Image.new("RGB", (margin + tile * per_class * len(CLASSES), header + tile * len(sites)), "white")
    draw = ImageDraw.Draw(sheet)
    for c, cls in enumerate(CLASSES):
        draw.text((margin + c * per_class * tile + 4, 4), cls, fill="black")
    for s, site in enumerate(sites):
        draw.text((4, header + s * tile + tile // 2 - 6), site, fill="black")
        for c, cls in enumerate(CLASSES):
            picks = [r for r in rows if r.site == site and r.label == cls][:per_class]
            for k, r in enumerate(picks):
                with Image.open(r.path) as im:
                    thumb = im.convert("RGB").resize((tile - 2, tile - 2), Image.Resampling.BILINEAR)
                sheet.paste(thumb, (margin + (c * per_class + k) * tile + 1, header + s * tile + 1))
    write_with(path, lambda tmp: sheet.save(tmp, format="PNG"))


def summarize(rows: Sequence[SourceRow]) -> dict[str, dict[str, int]]:
    counts = Counter((r.site, r.label) for r in rows)
    sites = dict.fromkeys(r.site for r in rows)
    return {site: {cls: counts[(site, cls)] for cls in CLASSES} for site in sites}


def run_cohort(cfg: CohortConfig, out_dir: str | Path, threads: int = 1) -> dict:
    """Write every ``results/cohort`` artifact with its provenance sidecar; return the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    block = cfg.model_dump(mode="json")
    summary: dict = {"mode": cfg.mode}
    if cfg.mode == "synthetic":
        rows, members = synthesize(cfg.synthetic, out, threads)
        write_planted(out / "planted_families.csv", members)
        planted = [m for m in members if m.transform]
        summary |= {"profile": cfg.synthetic.profile, "seed": cfg.synthetic.seed,
                    "originals": summarize([r for r, m in zip(rows, members, strict=True) if not m.transform]),
                    "planted_copies": len(planted), "planted_families": len({m.family for m in planted}),
                    "site_styles": {k: asdict(v) for k, v in SITE_STYLES.items()}}
        extra_outputs = ["planted_families.csv"]
    else:
        rows, excluded = collect_sources(cfg.real.sources)
        write_with(out / "excluded.csv", lambda tmp: tmp.write_text(
            "path,reason\n" + "".join(f"{json.dumps(e.path)},{json.dumps(e.reason)}\n" for e in excluded)))
        if excluded:  # never silently: every file that is not read is counted here and listed in excluded.csv
            log.warning("cohort: %d file(s) below the sources are not read, listed with their reason in %s: %s",
                        len(excluded), out / "excluded.csv",
                        dict(Counter(e.reason.split(" (")[0] for e in excluded).most_common()))
        patients = {(r.site, r.patient) for r in rows if r.patient}
        summary |= {"excluded": len(excluded), "inventory": sources_inventory(cfg.real.sources),
                    "patients_or_slides": len(patients),
                    "images_with_patient": sum(1 for r in rows if r.patient)}
        extra_outputs = ["excluded.csv"]
    write_with(out / "sources.csv", lambda tmp: write_sources_csv(tmp, rows))
    summary |= {"images": len(rows), "listed": summarize(rows)}
    contact_sheet(rows, out / "contact_sheet.png")
    # real data: the dataset folders are the inputs; synthetic: the config alone determines the bytes
    inputs = {f"{spec.site or spec.kind}:{spec.root}": spec.root for spec in cfg.real.sources} \
        if cfg.mode == "real" else {}
    prov = provenance_block(STAGE, block, inputs)
    write_json(out / "summary.json", {**summary, "provenance": prov})
    for name in ["sources.csv", "contact_sheet.png", *extra_outputs]:
        write_sidecar(out / name, prov)
    return summary

