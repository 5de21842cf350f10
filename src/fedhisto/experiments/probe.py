"""Experiment 5, stain-sensitivity probe: does a label-free look at the frozen encoder, taken before any
federated training, rank the encoders as the dose-response gap (v2 minus FedAvg-PEFT) does?

Per dose-response encoder condition, on the shifted cohort's tissues (:mod:`fedhisto.model.stain_probe`):

- ``paired_stain``: the tissues at the lowest severity (the anchor client site), each drawn twice
  through v2's stain perturbation at evaluation geometry;
- ``shift``: each tissue at the lowest severity against the same tissue rendered at severity s
  (evaluation transform, no perturbation): the real stain/scanner shift the dose-response curve
  walks along.

The summary puts each encoder's probe beside its v2-vs-FedAvg-PEFT paired macro-F1 difference from
the dose-response experiment and says whether the two order the encoders the same way.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

from pydantic import Field

from fedhisto.config.study import Config
from fedhisto.experiments.dose_response import condition_config, condition_inputs, encoder_pattern
from fedhisto.experiments.framework import (
    ROOT,
    Experiment,
    Step,
    encoder_dir,
    summary_dir,
    summary_files,
    warm,
)
from fedhisto.experiments.layout import experiment_block
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block, runtime_block, write_sidecar
from fedhisto.infra.settings_base import Strict, identity_dump

STAGE = "experiments"
PROBE_COLUMNS = ("ratio", "ratio_same_class", "retrieval_top1")
PER_IMAGE_COLUMNS = ("measure", "severity", "sample_id", "within", "nearest_other", "hit_a_to_b", "hit_b_to_a")


NAME = "probe"


class ProbeConfig(Strict):
    """Stain-sensitivity probe of each dose-response encoder on the shifted cohort's tissues."""

    seed: int = Field(5151, description="seed of the two stain draws per image")


def probe_encoder_inputs(cfg: Config, encoder: str) -> dict[str, str | list[str]]:
    """The shifted cohort and the folder of a dose-response condition's frozen encoder (none: from its config)."""
    return {"cohort": f"{ROOT}/dose_response/cohort/cohort.csv",
            "encoder": condition_inputs(cfg, f"dose_response/{encoder}")["encoder"]}


def probe_files(cfg: Config) -> dict[str, str]:
    """Per dose-response encoder condition: its probe's JSON."""
    return {label: f"{ROOT}/probe/{label}/probe.json" for label in cfg.experiments.dose_response.labels()}


def probe_block(cfg: Config, encoder: str) -> dict:
    """What one encoder's probe depends on beyond its input files."""
    c = condition_config(cfg, f"dose_response/{encoder}")
    x = cfg.experiments
    return {"probe": x.probe.model_dump(mode="json"), "severities": x.dose_response.severities,
            "encoder": identity_dump(c.model.encoder), "views": identity_dump(c.views),
            "resamples": x.resamples, "bootstrap_seed": x.bootstrap_seed, "eval_batch": c.evaluate.eval_batch}


def _probe(smk, cfg: Config) -> None:
    warm(smk, "fedhisto.experiments.probe:probe_condition", cfg, smk.wildcards.encoder, smk.input.cohort,
         Path(smk.output.json).parent, encoder_dir=encoder_dir(smk), threads=smk.threads)


def _summarise(smk, cfg: Config) -> None:
    warm(smk, "fedhisto.experiments.probe:summarise_probe", dict(smk.params.probes), smk.input.dose_response, cfg,
         summary_dir(smk))


class Probe(Experiment):
    name = NAME
    settings = ProbeConfig

    def steps(self, cfg: Config) -> list[Step]:
        return [Step("probe_encoder", {"json": f"{ROOT}/probe/{{encoder}}/probe.json",
                                       "per_image": f"{ROOT}/probe/{{encoder}}/per_image.csv"},
                     _probe, inputs=lambda w: probe_encoder_inputs(cfg, w.encoder), log="logs/experiments/probe/{encoder}.log",
                     params={"block": lambda w: probe_block(cfg, w.encoder)}, resources="predict_encoder",
                     wildcard_constraints={"encoder": encoder_pattern(cfg)}),
                Step("summarize_probe", summary_files(NAME), _summarise,
                     inputs={"probes": list(probe_files(cfg).values()),
                             "dose_response": f"{ROOT}/dose_response/dose_response.json"},
                     params={"probes": probe_files(cfg), "block": experiment_block(cfg, NAME)})]


# ------------------------------------------------------------------ analysis
def _tissues_by_severity(cohort_csv: str | Path, severities: list[float]) -> dict[float, list[dict]]:
    """Rows per severity, each list in the same tissue order (the lowest severity's)."""
    from fedhisto.model.stain_probe import ProbeError

    by: dict[float, dict[str, dict]] = defaultdict(dict)
    with Path(cohort_csv).open() as fh:
        for r in csv.DictReader(fh):
            by[float(r["severity"])][r["tissue_id"]] = r
    missing = [s for s in severities if s not in by]
    if missing:
        raise ProbeError(f"{cohort_csv}: no image at severity {missing} (experiments.dose_response.severities)")
    tissues = sorted(by[severities[0]])
    for s in severities:
        absent = sorted(set(tissues) - set(by[s]))
        if absent:
            raise ProbeError(f"{cohort_csv}: tissue {absent[0]} has no image at severity {s} ({len(absent)} missing)")
    return {s: [by[s][t] for t in tissues] for s in severities}


def probe_condition(cfg: Config, encoder: str, cohort_csv: str | Path, out_dir: str | Path,
                    encoder_dir: str | None = None, threads: int = 1) -> dict:
    """One encoder condition's probe: ``probe.json`` and ``per_image.csv`` in ``out_dir``."""
    import torch

    from fedhisto.model.build import pick_device
    from fedhisto.model.encoder import load_encoder
    from fedhisto.model.stain_probe import (
        clean_view,
        embed,
        load_probe_image,
        pair_sensitivity,
        per_image_rows,
        stain_sensitivity,
        summary_of,
    )

    torch.set_num_threads(max(threads, 1))
    c = condition_config(cfg, f"dose_response/{encoder}")
    device = pick_device(c)  # the step declares the encoder's GPU: the embeddings are computed there
    x = cfg.experiments
    severities = list(x.dose_response.severities)
    rows = _tissues_by_severity(cohort_csv, severities)
    model = load_encoder(c.model.encoder, encoder_dir)
    images = {s: [load_probe_image(r["path"], c.views.crop_size) for r in rows[s]] for s in severities}
    base, ids = severities[0], [r["sample_id"] for r in rows[severities[0]]]
    batch = c.evaluate.eval_batch
    measures, per_image = [], []
    labels = [r["label"] for r in rows[base]]  # the same tissue has one class at every severity
    paired = stain_sensitivity(model, list(zip(ids, images[base], strict=True)), c.views, x.probe.seed,
                               x.resamples, x.bootstrap_seed, batch, labels, device)
    measures.append({"measure": "paired_stain", "severity": base, **summary_of(paired)})
    per_image += per_image_rows(ids, paired, measure="paired_stain", severity=base)
    clean = {s: embed(model, [clean_view(im, c.views) for im in images[s]], batch, device) for s in severities}
    for s in severities[1:]:
        shifted = pair_sensitivity(clean[base], clean[s], x.resamples, x.bootstrap_seed, labels)
        measures.append({"measure": "shift", "severity": s, **summary_of(shifted)})
        per_image += per_image_rows(ids, shifted, measure="shift", severity=s)
    out = Path(out_dir)
    inputs = {"cohort": cohort_csv, **({"encoder": encoder_dir} if encoder_dir else {})}
    prov = provenance_block(STAGE, {"experiment": "probe", "encoder": encoder, "probe": x.probe.model_dump(mode="json"),
                                    "model_encoder": identity_dump(c.model.encoder),
                                    "views": identity_dump(c.views), "resamples": x.resamples,
                                    "bootstrap_seed": x.bootstrap_seed}, inputs)
    prov["runtime"] = runtime_block(device)  # where the embeddings were computed
    write_csv(out / "per_image.csv", per_image, PER_IMAGE_COLUMNS)
    write_sidecar(out / "per_image.csv", prov)
    summary = {"encoder": encoder, "model_encoder": c.model.encoder.name, "tissues": len(ids),
               "measures": measures, "provenance": prov}
    write_json(out / "probe.json", summary)
    return summary


def _gaps(dose_json: str | Path) -> dict[tuple[str, float], dict]:
    got = json.loads(Path(dose_json).read_text())
    return {(d["encoder"], float(d["severity"])): d for d in got["v2_vs_fedavg"]}


def _order(values: dict[str, float]) -> list[str]:
    """Encoders from the largest value down (ties by name, so the order is stable)."""
    return sorted(values, key=lambda k: (-values[k], k))


def summarise_probe(probe_jsons: dict[str, str], dose_json: str | Path, cfg: Config, out_dir: str | Path) -> dict:
    """``probe_jsons``: encoder condition -> its probe.json; ``dose_json``: the dose-response summary."""
    from fedhisto.model.stain_probe import ProbeError

    gaps = _gaps(dose_json)
    top = max(cfg.experiments.dose_response.severities)
    rows = []
    for encoder, path in probe_jsons.items():
        for m in json.loads(Path(path).read_text())["measures"]:
            gap_s = top if m["measure"] == "paired_stain" else float(m["severity"])
            gap = gaps.get((encoder, gap_s))
            if gap is None:
                raise ProbeError(f"{dose_json}: no v2-vs-FedAvg-PEFT difference for encoder {encoder!r} at "
                                 f"severity {gap_s}")
            rows.append({"encoder": encoder, "measure": m["measure"], "severity": m["severity"],
                         "images": m["images"],
                         **{f"{k}{suffix}": m[k][field] for k in PROBE_COLUMNS if k in m
                            for suffix, field in (("", "estimate"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high"))},
                         "gap_severity": gap_s, "gap": gap["difference"], "gap_ci_low": gap["ci_low"],
                         "gap_ci_high": gap["ci_high"]})
    paired = {r["encoder"]: r for r in rows if r["measure"] == "paired_stain"}
    ranking = {"probe_order": _order({e: r["ratio"] for e, r in paired.items()}),
               "gap_order": _order({e: r["gap"] for e, r in paired.items()}),
               "by": f"paired-stain ratio (larger: more stain-sensitive) vs v2 - FedAvg-PEFT at s = {top:g}"}
    ranking["agree"] = ranking["probe_order"] == ranking["gap_order"]
    out = Path(out_dir)
    write_csv(out / "probe.csv", rows, list(rows[0]))
    _figure(rows, paired, out / "probe.png")
    x = cfg.experiments
    summary = {"design": {**x.probe.model_dump(mode="json"), "encoders": list(probe_jsons),
                          "severities": list(x.dose_response.severities)},
               "resamples": x.resamples, "rows": rows, "ranking": ranking,
               "provenance": provenance_block(STAGE, {"experiment": "probe", **x.model_dump(mode="json")},
                                              {"dose_response": dose_json, **probe_jsons})}
    write_json(out / "probe.json", summary)
    return summary


def _figure(rows: list[dict], paired: dict[str, dict], path: Path) -> None:
    import numpy as np

    from fedhisto.infra.plotting import (  # plotting: only when drawing
        legend_outside,
        plot_bars_with_ci,
        plt,
        save_figure,
    )

    fig, (left, right) = plt.subplots(1, 2, figsize=(11.5, 4.4))
    encoders = list(paired)
    plot_bars_with_ci(left, encoders, [paired[e]["ratio"] for e in encoders],
                      [paired[e]["ratio_ci_low"] for e in encoders], [paired[e]["ratio_ci_high"] for e in encoders])
    left.set_ylabel("within / between cosine distance (95 % CI)")
    left.set_title("paired stain draws (v2's perturbation)")
    for e in encoders:
        sel = [r for r in rows if r["encoder"] == e and r["measure"] == "shift"]
        xs, ys = np.array([r["ratio"] for r in sel]), np.array([r["gap"] for r in sel])
        right.errorbar(xs, ys, xerr=[xs - [r["ratio_ci_low"] for r in sel], [r["ratio_ci_high"] for r in sel] - xs],
                       yerr=[ys - [r["gap_ci_low"] for r in sel], [r["gap_ci_high"] for r in sel] - ys],
                       fmt="o-", capsize=3, label=e)
        for r in sel:
            right.annotate(f"s={r['severity']:g}", (r["ratio"], r["gap"]), fontsize=7, xytext=(3, 3),
                           textcoords="offset points")
    right.axhline(0.0, color="grey", lw=0.8)
    right.set_xlabel("shift probe: same tissue at s = 0 vs s, within / between")
    right.set_ylabel("v2 - FedAvg-PEFT macro-F1 at s (95 % CI)")
    right.set_title("probe vs dose-response gap")
    legend_outside(right)
    save_figure(fig, path)
