"""Experiment 1, stain-shift dose-response: ensemble metrics against shift severity, per encoder condition.

The external cohort is re-rendered at several stain/scanner shift severities (``render_shifted_cohort``)
and crossed with the encoder: ``stain_invariant`` (the main runs), ``plain`` (a tiny encoder pretrained
without stain-perturbed views, retrained here) or any registry encoder (an entry, retrained on it).
Each cell (encoder condition x severity x method) scores the seeds' ensemble on the same tissues
rendered at that severity: macro-F1, balanced accuracy and ECE with 95 % bootstrap intervals,
and the v2-vs-FedAvg-PEFT paired bootstrap difference of macro-F1 (the bootstrap stage's test).
With an extra arm (``experiments.dose_response.extra_methods``, e.g. the stain-augmented
``fedavg_peft_stain``) also v2 - arm and arm - FedAvg-PEFT: paired consistency, or just augmentation?
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from fedhisto.config.model_settings import EncoderConfig
from fedhisto.config.stage_blocks import stage_block
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
from fedhisto.experiments.layout import experiment_block, main_inputs, run_dir
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block
from fedhisto.infra.settings_base import Strict
from fedhisto.registries.method_registry import Method

NAME = "dose_response"
TINY_ENCODERS = ("stain_invariant", "plain")
PLAIN = "dose_response/plain"  # the condition trained on the plain encoder
PLAIN_ENCODER = f"{ROOT}/dose_response/encoder_plain"
SHIFTED_COHORT = f"{ROOT}/dose_response/cohort/cohort.csv"


class DoseEncoder(Strict):
    """Another frozen encoder crossed with the shift severities: its condition retrains every principal
    method with ``model.encoder`` set to this entry of the encoder registry (its local folder or
    pinned hub revision), at its registry input size unless ``crop_size`` says otherwise, normalised
    as ``normalisation`` says. ``label`` names the condition's folder
    (``results/experiments/dose_response/<label>/``)."""

    label: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", description="condition folder name")
    name: str = Field(description="an encoder registry entry (model.encoder.name accepts it)")
    local_dir: str | None = Field(None, description="load from this folder instead of the hub")
    repo_id: str | None = Field(None, description="hub repository (default: the registry entry's)")
    revision: str | None = Field(None, description="pinned hub revision (default: the registry entry's)")
    crop_size: int | None = Field(None, ge=8, description="input size (default: the registry entry's)")
    normalisation: Literal["imagenet", "encoder"] = Field(
        "imagenet", description="imagenet: views.mean / views.std; encoder: the registry entry's statistics")

    def encoder_config(self):
        """This entry as ``model.encoder`` (validated there: an unknown name lists the known ones)."""
        given = {"repo_id": self.repo_id, "revision": self.revision}
        return EncoderConfig(name=self.name, local_dir=self.local_dir, **{k: v for k, v in given.items() if v})

    @model_validator(mode="after")
    def _known(self) -> DoseEncoder:
        if self.label in TINY_ENCODERS:
            raise ValueError(f"label {self.label!r} is the name of a built-in condition; pick another")
        self.encoder_config()
        return self


class DoseResponseConfig(Strict):
    """External cohort rendered at several stain/scanner shift severities, crossed with the tiny
    encoder's stain invariance (pretrained with or without stain-perturbed views)."""

    severities: list[float] = Field(default_factory=lambda: [0.0, 0.5, 1.0, 1.5, 2.0], min_length=2,
                                    description="0: the anchor client site's stain and scanner; 1: the external site")
    anchor_site: Literal["site1", "site2", "site3", "site4", "site5"] = "site1"
    images_per_class: int = Field(60, ge=5, description="per severity; the same tissue at every severity")
    seed: int = Field(4242, description="tissue seed of the shifted cohort (never the cohort's or the pool's)")
    encoders: list[Literal["stain_invariant", "plain"] | DoseEncoder] = Field(
        default_factory=lambda: ["stain_invariant", "plain"], min_length=1,
        description="stain_invariant: the pipeline's encoder; plain: pretrained without stain-perturbed views; "
                    "{label, name, local_dir, ...}: any registry encoder (all methods retrained on it)")

    extra_methods: list[Method] = Field(
        default_factory=lambda: ["fedavg_peft_stain"],
        description="trained beside experiments.methods in this experiment only (issue 23: fedavg_peft_stain, the "
                    "stain-augmented FedAvg arm, answers 'paired consistency, or just augmentation?')")

    @model_validator(mode="after")
    def _ordered(self) -> DoseResponseConfig:
        if sorted(set(self.severities)) != list(self.severities) or min(self.severities) < 0:
            raise ValueError(f"severities must be distinct, ascending and >= 0 (got {self.severities})")
        labels = self.labels()
        if len(set(labels)) != len(labels):
            raise ValueError(f"experiments.dose_response.encoders: labels must be distinct (got {labels})")
        return self

    def labels(self) -> list[str]:
        """Condition names in order: the built-in ones as given, an entry by its label."""
        return [e if isinstance(e, str) else e.label for e in self.encoders]

    def entry(self, label: str) -> DoseEncoder | None:
        """The entry of a condition (None for the built-in tiny conditions)."""
        return next((e for e in self.encoders if not isinstance(e, str) and e.label == label), None)


# ------------------------------------------------------------------ conditions and runs
def encoder_conditions(cfg: Config) -> list[str]:
    return [f"dose_response/{label}" for label in cfg.experiments.dose_response.labels()]


def condition_config(cfg: Config, condition: str) -> Config:
    """The config a condition's runs train and predict with: ``cfg`` itself except for an encoder
    entry, whose encoder (no pipeline pretraining: its weights come from its folder or the hub), input
    size (the registry entry's unless the entry sets ``crop_size``) and normalisation replace the main ones."""
    from fedhisto.registries.encoder_registry import encoder_entry

    entry = cfg.experiments.dose_response.entry(condition.split("/", 1)[1])
    if entry is None:
        return cfg
    registry = encoder_entry(entry.name)
    views = {"crop_size": entry.crop_size or registry.input_size, "normalisation": entry.normalisation}
    if entry.normalisation == "encoder":
        views.update(mean=registry.mean, std=registry.std)
    model = cfg.model.model_copy(update={"encoder": entry.encoder_config(),
                                         "pretrain": cfg.model.pretrain.model_copy(update={"enabled": False})})
    return cfg.model_copy(update={"model": model, "views": cfg.views.model_copy(update=views)})


def condition_inputs(cfg: Config, condition: str) -> dict[str, str | list[str]]:
    """The main manifest; the plain condition its own encoder, an entry its config's."""
    entry = cfg.experiments.dose_response.entry(condition.split("/", 1)[1])
    inputs = main_inputs(cfg)
    if condition == PLAIN:
        inputs["encoder"] = [PLAIN_ENCODER]
    elif entry:
        inputs["encoder"] = []
    return inputs


def dose_methods(cfg: Config) -> list[str]:
    """The experiment's methods: the principal ones and its extra arms."""
    x = cfg.experiments
    return list(dict.fromkeys([*x.methods, *x.dose_response.extra_methods]))


def dose_runs(cfg: Config) -> list[tuple[str, str, int]]:
    """(condition, method, seed) whose external predictions the experiment re-scores."""
    return [(c, m, s) for c in encoder_conditions(cfg) for m in dose_methods(cfg) for s in cfg.experiments.seeds]


def shifted_predictions(cfg: Config) -> list[tuple[str, str, int, str]]:
    """(encoder condition, method, seed, CSV) of the summary."""
    return [(c, m, s, f"{ROOT}/{c}/predictions/{m}/seed{s}.csv") for c, m, s in dose_runs(cfg)]


def plain_encoder_config(cfg: Config) -> Config:
    """The config that pretrains the plain encoder (no stain-perturbed views)."""
    pretrain = cfg.model.pretrain.model_copy(update={"stain_views": False})
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"pretrain": pretrain})})


def entry_resources(cfg: Config, label: str) -> dict[str, int]:
    """Training resources of an encoder entry's runs: its registry entry's hints."""
    from fedhisto.registries.encoder_registry import encoder_entry

    entry = cfg.experiments.dose_response.entry(label)
    if entry is None:
        raise ValueError(f"{label!r} is not an experiments.dose_response.encoders entry")
    r = encoder_entry(entry.name).resources
    return {"mem_mb": r.train_mem_mb, "runtime": r.train_runtime, "gpu": r.gpu}


def shifted_inputs(cfg: Config, encoder: str, method: str, seed: int) -> dict[str, str | list[str]]:
    """A run's checkpoint (main runs for the stain-invariant encoder) and what it predicts with."""
    condition = f"dose_response/{encoder}"
    if encoder == "stain_invariant" and not cfg.model.pretrain.stain_views:  # evaluated only when the job is needed
        raise ValueError("experiments.dose_response.encoders names 'stain_invariant' (the main runs) but "
                         "model.pretrain.stain_views is false: the main encoder is then the plain one")
    return {"status": f"{run_dir(cfg, condition, 'train', method, seed)}/status.json",
            "cohort": SHIFTED_COHORT, **condition_inputs(cfg, condition)}


def shifted_block(cfg: Config, method: str, seed: int, encoder: str = "stain_invariant") -> dict:
    """Shifted-cohort predictions are never temperature-scaled: the predict block without that flag
    (of the encoder condition's config: the main one for the built-in tiny conditions)."""
    block = stage_block(condition_config(cfg, f"dose_response/{encoder}"), "predict", method=method, seed=seed)
    block.pop("temperature_scaling", None)
    return block


def encoder_pattern(cfg: Config) -> str:
    """Wildcard constraint of ``{encoder}``: the built-in tiny conditions and the configured entries."""
    return "|".join(dict.fromkeys([*TINY_ENCODERS, *cfg.experiments.dose_response.labels()]))


def entry_pattern(cfg: Config) -> str:
    """Wildcard constraint of ``{label}``: the configured encoder entries only (never matches when none)."""
    x = cfg.experiments.dose_response
    return alternatives([e for e in x.labels() if x.entry(e)])


# ------------------------------------------------------------------ steps
def _render(smk, cfg: Config) -> None:
    from fedhisto.experiments.severity_render import run_render_shift

    run_render_shift(cfg, Path(smk.output.cohort).parent, threads=smk.threads)


def _pretrain_plain(smk, cfg: Config) -> None:
    warm(smk, "fedhisto.pretrain.stage:run_pretrain", plain_encoder_config(cfg), smk.output.encoder, threads=smk.threads,
         manifest_csv=smk.input.get("manifest"))


def _train_entry(smk, cfg: Config) -> None:
    w = smk.wildcards
    warm(smk, "fedhisto.train.stage:run_train", w.method, int(w.seed), smk.input.manifest, smk.input.identity,
         smk.input.descriptors, condition_config(cfg, f"dose_response/{w.label}"), Path(smk.output.status).parent,
         encoder_dir=None, threads=smk.threads)


def _predict_shifted(smk, cfg: Config) -> None:
    w = smk.wildcards
    warm(smk, "fedhisto.experiments.shifted:predict_shifted", w.method, int(w.seed), Path(smk.input.status).parent,
         smk.input.manifest, smk.input.identity, smk.input.descriptors, smk.input.cohort,
         condition_config(cfg, f"dose_response/{w.encoder}"), smk.output.predictions, encoder_dir=encoder_dir(smk),
         threads=smk.threads)


def _summarise(smk, cfg: Config) -> None:
    warm(smk, "fedhisto.experiments.dose_response:summarise_dose_response", [tuple(r) for r in smk.params.runs],
         smk.input.cohort, cfg, summary_dir(smk))


class DoseResponse(Experiment):
    name = NAME
    settings = DoseResponseConfig

    def conditions(self, cfg: Config) -> list[str]:
        return [PLAIN]

    def condition_inputs(self, cfg: Config, condition: str) -> dict[str, str | list[str]]:
        return condition_inputs(cfg, condition)

    def condition_config(self, cfg: Config, condition: str) -> Config:
        return condition_config(cfg, condition)

    def is_main(self, cfg: Config, condition: str) -> bool:
        return condition == "dose_response/stain_invariant"

    def steps(self, cfg: Config) -> list[Step]:
        from fedhisto.experiments.layout import pretrain_inputs

        runs = shifted_predictions(cfg)
        here = f"{ROOT}/dose_response"
        return [
            Step("render_shifted_cohort", {"cohort": SHIFTED_COHORT, "sheet": f"{here}/cohort/contact_sheet.png"},
                 _render, params={"block": stage_block(cfg, "shift_cohort")}, threads=2,
                 resources={"mem_mb": 2000, "runtime": 20, "gpu": 0}),
            Step("pretrain_plain_encoder", {"encoder": PLAIN_ENCODER}, _pretrain_plain,
                 inputs=lambda w: pretrain_inputs(cfg), directories=("encoder",), threads=2,
                 params={"block": stage_block(plain_encoder_config(cfg), "pretrain")},
                 resources={"mem_mb": 3000, "runtime": 30, "gpu": 0}),
            # an encoder entry ({label, name, local_dir}): the main manifest, retrained on that encoder
            Step("train_encoder_condition", {"status": f"{here}/{{label}}/train/{{method}}/seed{{seed}}/status.json",
                                             "history": f"{here}/{{label}}/train/{{method}}/seed{{seed}}/history.csv"},
                 _train_entry, inputs=lambda w: condition_inputs(cfg, f"dose_response/{w.label}"),
                 log="logs/experiments/dose_response/{label}/train/{method}/seed{seed}.log",
                 params={"block": lambda w: stage_block(condition_config(cfg, f"dose_response/{w.label}"), "train",
                                                        method=w.method, seed=w.seed)},
                 resources=lambda w: entry_resources(cfg, w.label),
                 wildcard_constraints={"label": entry_pattern(cfg)}),
            Step("predict_shifted_cohort", {"predictions": f"{here}/{{encoder}}/predictions/{{method}}/seed{{seed}}.csv"},
                 _predict_shifted, inputs=lambda w: shifted_inputs(cfg, w.encoder, w.method, w.seed),
                 log="logs/experiments/dose_response/{encoder}/predict/{method}/seed{seed}.log",
                 params={"block": lambda w: shifted_block(cfg, w.method, w.seed, w.encoder)},
                 resources="predict_encoder", wildcard_constraints={"encoder": encoder_pattern(cfg)}),
            Step("summarize_dose_response", summary_files(NAME), _summarise,
                 inputs={"cohort": SHIFTED_COHORT, "predictions": [r[3] for r in runs]},
                 params={"runs": [list(r) for r in runs], "block": experiment_block(cfg, NAME)}),
        ]


# ------------------------------------------------------------------ analysis
STAGE = "experiments"
METRICS = ("macro_f1", "balanced_accuracy", "ece")
DIFFERENCE = ("past_v2", "fedavg_peft")


def difference_pairs(methods: list[str], extra: list[str]) -> list[tuple[str, str]]:
    """(method, reference) of every paired difference: v2 - FedAvg-PEFT, then per extra arm v2 - arm
    and arm - FedAvg-PEFT (what the arm's augmentation alone buys)."""
    pairs = [DIFFERENCE]
    for arm in extra:
        if arm not in DIFFERENCE:
            pairs += [(DIFFERENCE[0], arm), (arm, DIFFERENCE[1])]
    return [p for p in dict.fromkeys(pairs) if set(p) <= set(methods)]


def _severity_of(cohort_csv: str | Path) -> dict[str, float]:
    with Path(cohort_csv).open() as fh:
        return {r["sample_id"]: float(r["severity"]) for r in csv.DictReader(fh)}


def summarise_dose_response(runs: list[tuple[str, str, int, str]], cohort_csv: str | Path, cfg: Config,
                            out_dir: str | Path) -> dict:
    """``runs``: (encoder condition, method, seed, shifted-predictions CSV)."""
    import numpy as np

    from fedhisto.stats.ensemble_intervals import metric_replicates, paired_macro_f1, summarise
    from fedhisto.stats.prediction_files import AlignmentError, ensemble

    x = cfg.experiments
    severity_of = _severity_of(cohort_csv)
    files: dict[tuple[str, str], list[str]] = defaultdict(list)
    for condition, method, _seed, path in runs:
        files[(condition.split("/")[-1], method)].append(path)
    cells, diffs = [], []
    ensembles: dict[tuple[str, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    first_ids: list[str] | None = None
    for (encoder, method), paths in files.items():
        ids, y, probs = ensemble(paths)
        unknown = [i for i in ids if i not in severity_of]
        if unknown:
            raise AlignmentError(f"{paths[0]}: {len(unknown)} sample id(s) not in {cohort_csv} (e.g. {unknown[0]})")
        if first_ids is not None and ids != first_ids:  # the paired differences need the same images
            raise AlignmentError(f"{paths[0]}: its images differ from the other methods' shifted predictions")
        first_ids = ids
        ensembles[(encoder, method)] = (np.array([severity_of[i] for i in ids]), y, probs)
    for (encoder, method), (sev, y, probs) in sorted(ensembles.items()):
        for s in x.dose_response.severities:
            sel = sev == s
            if not sel.any():
                raise AlignmentError(f"{cohort_csv}: no image at severity {s} (experiments.dose_response.severities)")
            reps = metric_replicates(y[sel], probs[sel], x.resamples, x.bootstrap_seed, x.calibration.bins)
            cells.append({"encoder": encoder, "severity": s, "method": method, "seeds": len(files[(encoder, method)]),
                          "images": int(sel.sum()), **summarise(reps, METRICS)})
    pairs = difference_pairs(sorted({m for _, m in ensembles}), list(x.dose_response.extra_methods))
    for encoder in sorted({e for e, _ in ensembles}):
        for pair in pairs:
            if not all((encoder, m) in ensembles for m in pair):
                continue
            (sev, y, pa), (_, _, pb) = (ensembles[(encoder, m)] for m in pair)
            for s in x.dose_response.severities:
                sel = sev == s
                diffs.append({"encoder": encoder, "severity": s, "method": pair[0], "reference": pair[1],
                              "images": int(sel.sum()),
                              **paired_macro_f1(y[sel], pa[sel], pb[sel], x.resamples, x.bootstrap_seed)})
    principal = [d for d in diffs if (d["method"], d["reference"]) == DIFFERENCE]
    out = Path(out_dir)
    write_csv(out / "dose_response.csv", cells, list(cells[0]))
    write_csv(out / "v2_vs_fedavg_by_severity.csv", principal, list(principal[0]) if principal else ["encoder"])
    write_csv(out / "paired_differences.csv", diffs, list(diffs[0]) if diffs else ["encoder"])
    _figure(cells, diffs, out / "dose_response.png")
    summary = {"design": x.dose_response.model_dump(mode="json"), "methods": sorted({m for _, m in ensembles}),
               "seeds": list(x.seeds), "resamples": x.resamples, "cells": cells, "v2_vs_fedavg": principal,
               "paired_differences": diffs,
               "provenance": provenance_block(STAGE, {"experiment": "dose_response", **x.model_dump(mode="json")},
                                              {"cohort": cohort_csv, **{f"run{i}": r[3] for i, r in enumerate(runs)}})}
    write_json(out / "dose_response.json", summary)
    return summary


def _figure(cells: list[dict], diffs: list[dict], path: Path) -> None:
    import numpy as np

    from fedhisto.infra.plotting import plot_lines_with_bands, plt, save_figure  # plotting: only when drawing

    encoders = sorted({c["encoder"] for c in cells})
    fig, axes = plt.subplots(2, len(encoders), figsize=(5.2 * len(encoders) + 2.2, 7.5), squeeze=False,
                             sharey="row")
    for col, encoder in enumerate(encoders):
        series = {}
        for method in sorted({c["method"] for c in cells if c["encoder"] == encoder}):
            rows = sorted((c for c in cells if c["encoder"] == encoder and c["method"] == method),
                          key=lambda c: c["severity"])
            series[method] = tuple(np.array([r[k] for r in rows]) for k in ("macro_f1", "macro_f1_ci_low",
                                                                            "macro_f1_ci_high"))
        xs = sorted({c["severity"] for c in cells})
        plot_lines_with_bands(axes[0, col], xs, series)
        axes[0, col].set_title(f"encoder: {encoder}")
        axes[0, col].set_ylabel("ensemble macro-F1 (95 % CI)")
        pairs = list(dict.fromkeys((d["method"], d["reference"]) for d in diffs if d["encoder"] == encoder))
        curves = {}
        for method, reference in pairs:
            rows = sorted((d for d in diffs if d["encoder"] == encoder and (d["method"], d["reference"]) ==
                           (method, reference)), key=lambda d: d["severity"])
            curves[f"{method} - {reference}"] = tuple(np.array([r[k] for r in rows])
                                                      for k in ("difference", "ci_low", "ci_high"))
        if curves:
            plot_lines_with_bands(axes[1, col], xs, curves)
        axes[1, col].axhline(0.0, color="grey", lw=0.8)
        axes[1, col].set_ylabel("paired macro-F1 difference (95 % CI)")
        axes[1, col].set_xlabel("shift severity (0: client site, 1: external site)")
    save_figure(fig, path)
