"""Experiment: the study's delta-SVD beside the federated-LoRA literature's aggregators, for v2 and FedAvg-PEFT.

The study aggregates LoRA by delta-SVD (eq. 5) and never compares it with anything. Here the PAST
family's methods (``experiments.lora_aggregation.methods``, default FedAvg-PEFT and v2) train under
each server aggregator (``train.past.lora_aggregator``: delta_svd, factor_mean, flexlora at equal
ranks, fedex_lora, ffa_lora; FedSA-LoRA keeps one model per site and is its own method), on matched
seeds, under two frozen encoders: the embedded default's (``main``) and the dose-response
experiment's plain encoder (``plain``, pretrained without stain views). Per (encoder, method,
aggregator): the seeds' ensemble external macro-F1 with its 95 % bootstrap interval, the paired
difference against delta-SVD on the same images, the traffic of a round (Table 8's count from the
real tensors, FedEx-LoRA's dense offsets included), and the rank-collapse check: the energy share of
the aggregate's leading singular directions over rounds (``lora_aggregation_runs.update_spectrum``).

Outputs in ``results/experiments/lora_aggregation/``: ``lora_aggregation.csv`` (one row per cell),
``lora_aggregation.json`` (cells, paired differences, per-round spectra and traffic, provenance) and
``lora_aggregation.png`` (external macro-F1 against traffic per round; leading-direction energy share
per round).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from fedhisto.config.study import Config
from fedhisto.experiments.framework import (
    ROOT,
    Experiment,
    Step,
    alternatives,
    encoder_dir,
    summary_dir,
    summary_files,
    warm,
)
from fedhisto.infra.settings_base import Strict

NAME = "lora_aggregation"
HERE = f"{ROOT}/{NAME}"
ENCODERS = ("main", "plain")
AGGREGATORS = ("delta_svd", "factor_mean", "flexlora", "fedex_lora", "ffa_lora")
REFERENCE = "delta_svd"


class LoraAggregationSettings(Strict):
    """[ours] v2 and FedAvg-PEFT under each server LoRA aggregator, on two frozen encoders."""

    encoders: list[Literal["main", "plain"]] = Field(
        default_factory=lambda: list(ENCODERS), min_length=1,
        description="main: the pipeline's encoder; plain: the dose-response experiment's plain encoder")
    aggregators: list[Literal["delta_svd", "factor_mean", "flexlora", "fedex_lora", "ffa_lora"]] = Field(
        default_factory=lambda: list(AGGREGATORS), min_length=1,
        description="train.past.lora_aggregator values; delta_svd (the study's) is the paired reference")
    methods: list[str] = Field(default_factory=lambda: ["fedavg_peft", "past_v2"], min_length=1,
                               description="methods of the PAST family (train.past), trained under each aggregator")
    seeds: list[int] = Field(default_factory=lambda: [11, 22, 33], min_length=1,
                             description="matched seeds of every arm")

    @field_validator("methods")
    @classmethod
    def _past_family(cls, methods: list[str]) -> list[str]:
        from fedhisto.registries.method_registry import registration

        for m in methods:
            if registration(m).config_key != "past":
                raise ValueError(f"experiments.lora_aggregation.methods: {m!r} is not a PAST-family method (its "
                                 "aggregator is train.past.lora_aggregator); e.g. fedavg_peft, past_v2")
        return methods


def arms(settings: LoraAggregationSettings) -> list[tuple[str, str, str, int]]:
    """(encoder, aggregator, method, seed) of every arm."""
    return [(e, a, m, s) for e in settings.encoders for a in settings.aggregators for m in settings.methods
            for s in settings.seeds]


def arm_dir(root: str | Path, encoder: str, aggregator: str, method: str, seed: int) -> Path:
    return Path(root) / encoder / aggregator / method / f"seed{seed}"


# ------------------------------------------------------------------ the experiment's steps
def arm_inputs(cfg: Config, encoder: str) -> dict[str, str | list[str]]:
    """The main manifest, identity and descriptors; the frozen encoder of the condition (main or plain)."""
    from fedhisto.experiments.dose_response import PLAIN_ENCODER
    from fedhisto.experiments.layout import main_inputs

    inputs = main_inputs(cfg)
    if encoder == "plain":
        inputs["encoder"] = [PLAIN_ENCODER]
    return inputs


def arm_block(cfg: Config, aggregator: str, method: str, seed: int | str) -> dict:
    """What one arm depends on beyond its input files: its training and prediction stage blocks."""
    from fedhisto.config.stage_blocks import stage_block
    from fedhisto.experiments.lora_aggregation_runs import arm_config

    c = arm_config(cfg, aggregator, method, int(seed))
    return {"train": stage_block(c, "train", method=method, seed=int(seed)),
            "predict": stage_block(c, "predict", method=method, seed=int(seed))}


def summary_runs(cfg: Config) -> list[tuple[str, str, str, int, str, str]]:
    out = []
    for e, a, m, s in arms(cfg.experiments.lora_aggregation):
        folder = arm_dir(HERE, e, a, m, s)
        out.append((e, a, m, s, f"{folder}/predictions/external.csv", f"{folder}/rounds.json"))
    return out


def _arm(smk: Any, cfg: Config) -> None:
    w = smk.wildcards
    warm(smk, "fedhisto.experiments.lora_aggregation_runs:train_arm", cfg, w.aggregator, w.method, int(w.seed),
         smk.input.manifest, smk.input.identity, smk.input.descriptors, str(Path(smk.output.rounds).parent),
         encoder_dir=encoder_dir(smk), threads=smk.threads)


def _summarise(smk: Any, cfg: Config) -> None:
    from fedhisto.infra.provenance import provenance_block

    x = cfg.experiments
    runs = summary_runs(cfg)
    prov = provenance_block("experiments", {"experiment": NAME, NAME: x.lora_aggregation.model_dump(mode="json"),
                                            "resamples": x.resamples, "bootstrap_seed": x.bootstrap_seed},
                            {f"run{i}": r[5] for i, r in enumerate(runs)})
    warm(smk, "fedhisto.experiments.lora_aggregation:summarise_lora_aggregation", runs, x.resamples,
         x.bootstrap_seed, str(summary_dir(smk)), prov)


class LoraAggregation(Experiment):
    name = NAME
    settings = LoraAggregationSettings

    def steps(self, cfg: Config) -> list[Step]:
        x = cfg.experiments.lora_aggregation
        arm = "{lencoder}/{aggregator}/{method}/seed{seed}"
        return [
            Step("train_lora_aggregation_arm", {"rounds": f"{HERE}/{arm}/rounds.json",
                                                "external": f"{HERE}/{arm}/predictions/external.csv"},
                 _arm, inputs=lambda w: arm_inputs(cfg, w.lencoder),
                 params={"block": lambda w: arm_block(cfg, w.aggregator, w.method, w.seed)},
                 log=f"logs/experiments/{NAME}/{arm}.log", resources="train",
                 wildcard_constraints={"lencoder": alternatives(list(x.encoders)),
                                       "aggregator": alternatives(list(x.aggregators))}),
            Step(f"summarize_{NAME}", summary_files(NAME), _summarise,
                 inputs={"arms": [p for r in summary_runs(cfg) for p in r[4:]]},
                 params={"block": {"experiment": NAME, NAME: x.model_dump(mode="json"),
                                   "resamples": cfg.experiments.resamples,
                                   "bootstrap_seed": cfg.experiments.bootstrap_seed}}),
        ]


def summarise_lora_aggregation(runs: list[tuple[str, str, str, int, str, str]], resamples: int, bootstrap_seed: int,
                               out_dir: str | Path, provenance: dict | None = None) -> dict:
    """``runs``: (encoder, aggregator, method, seed, external predictions CSV, rounds.json)."""
    import numpy as np

    from fedhisto.infra.atomic import write_csv, write_json
    from fedhisto.stats.ensemble_intervals import metric_replicates, paired_macro_f1, summarise
    from fedhisto.stats.prediction_files import AlignmentError, ensemble

    groups: dict[tuple[str, str, str], list[tuple[int, str, str]]] = defaultdict(list)
    for encoder, aggregator, method, seed, external, rounds in runs:
        groups[(encoder, method, aggregator)].append((seed, external, rounds))
    seeds_of = {k: sorted(s for s, _, _ in v) for k, v in groups.items()}
    if len({tuple(v) for v in seeds_of.values()}) > 1:
        raise AlignmentError(f"the arms are not on matched seeds: {seeds_of}")
    ensembles, cells, curves = {}, [], []
    for key, members in sorted(groups.items()):
        encoder, method, aggregator = key
        ids, y, probs = ensemble([p for _, p, _ in members])
        ensembles[key] = (ids, y, probs)
        reps = metric_replicates(y, probs, resamples, bootstrap_seed)
        per_seed = [json.loads(Path(r).read_text())["rounds"] for _, _, r in members]
        traffic = [np.mean([row["traffic_bytes"] for row in rows]) for rows in per_seed]
        last = [rows[-1] for rows in per_seed]
        cells.append({"encoder": encoder, "method": method, "aggregator": aggregator, "seeds": len(members),
                      "images": len(ids), **summarise(reps, ("macro_f1", "balanced_accuracy")),
                      "traffic_mib_per_round": float(np.mean(traffic)) / 2**20,
                      "rounds_mean": float(np.mean([len(rows) for rows in per_seed])),
                      "final_energy_share_top1": float(np.mean([r["energy_share"][0] for r in last])),
                      "final_effective_rank": float(np.mean([r["effective_rank"] for r in last]))})
        for t in range(1, max(len(rows) for rows in per_seed) + 1):
            at = [row for rows in per_seed for row in rows if row["round"] == t]
            curves.append({"encoder": encoder, "method": method, "aggregator": aggregator, "round": t, "seeds": len(at),
                           "energy_share": [float(np.mean(col)) for col in zip(*(r["energy_share"] for r in at),
                                                                                  strict=True)],
                           "effective_rank": float(np.mean([r["effective_rank"] for r in at])),
                           "traffic_mib": float(np.mean([r["traffic_bytes"] for r in at])) / 2**20})
    diffs = []
    for (encoder, method, aggregator), (ids, y, probs) in sorted(ensembles.items()):
        ref = ensembles.get((encoder, method, REFERENCE))
        if aggregator == REFERENCE or ref is None:
            continue
        if ref[0] != ids:
            raise AlignmentError(f"{encoder}/{method}: {aggregator}'s external images differ from {REFERENCE}'s")
        diffs.append({"encoder": encoder, "method": method, "aggregator": aggregator, "reference": REFERENCE,
                      **paired_macro_f1(y, probs, ref[2], resamples, bootstrap_seed)})
    out = Path(out_dir)
    write_csv(out / f"{NAME}.csv", cells, list(cells[0]))
    _figure(cells, curves, out / f"{NAME}.png")
    summary = {"cells": cells, "paired_vs_delta_svd": diffs, "rounds": curves, "resamples": resamples,
               "seeds": seeds_of[next(iter(seeds_of))], "provenance": provenance or {}}
    write_json(out / f"{NAME}.json", summary)
    return summary


def _figure(cells: list[dict], curves: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedhisto.infra.plotting import legend_outside, save_figure

    encoders = list(dict.fromkeys(c["encoder"] for c in cells))
    aggregators = list(dict.fromkeys(c["aggregator"] for c in cells))
    methods = list(dict.fromkeys(c["method"] for c in cells))
    colours = {a: f"C{k}" for k, a in enumerate(aggregators)}
    markers = dict(zip(methods, "osD^v<>", strict=False))
    styles = dict(zip(methods, ["-", "--", ":", "-."], strict=False))
    fig, axes = plt.subplots(2, len(encoders), figsize=(5.5 * len(encoders) + 2.6, 8.0), squeeze=False)
    for col, encoder in enumerate(encoders):
        ax = axes[0, col]
        for c in (c for c in cells if c["encoder"] == encoder):
            ax.errorbar(c["traffic_mib_per_round"], c["macro_f1"],
                        yerr=[[c["macro_f1"] - c["macro_f1_ci_low"]], [c["macro_f1_ci_high"] - c["macro_f1"]]],
                        fmt=markers[c["method"]], color=colours[c["aggregator"]], capsize=3,
                        label=f"{c['method']} / {c['aggregator']}")
        ax.set_xlabel("traffic per round (MiB, all clients, both ways)")
        ax.set_ylabel("external macro-F1 (ensemble, 95 % CI)")
        ax.set_title(f"encoder: {encoder}")
        ax = axes[1, col]
        for method in methods:
            for aggregator in aggregators:
                rows = sorted((r for r in curves if (r["encoder"], r["method"], r["aggregator"]) ==
                               (encoder, method, aggregator)), key=lambda r: r["round"])
                if rows:
                    ax.plot([r["round"] for r in rows], [r["energy_share"][0] for r in rows], styles[method],
                            color=colours[aggregator], marker=markers[method], ms=3,
                            label=f"{method} / {aggregator}")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("round")
        ax.set_ylabel("leading direction's energy share of dW")
    legend_outside(axes[0, -1], fontsize=7)
    legend_outside(axes[1, -1], fontsize=7)
    save_figure(fig, path)
