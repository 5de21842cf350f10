"""Loud warnings for settings that make a run say less than its tables suggest.

Two kinds. :func:`method_caveats`: a comparator that runs under a protocol its own paper does not
assume (each method declares its paper's assumptions in its own file, ``Strategy.assumptions``, and says
where a run departs, ``Strategy.protocol_departures``); the report prints each departure under its
tables and in the ``caveat`` column of every row of that method, and a paired comparison with a marked
arm carries the line too, so it is not read as a finding about the method its name says.

:func:`run_caveats`: settings that make a real-data run say little.

Tried as a new user would, the embedded default on real LC25000 families (``cohort.mode: real``)
sits at validation macro-F1 0.556 (one class never predicted) for most runs, which then early-stop
at round 5: the tiny encoder was pretrained on synthetic tissue only, and the embedded default's
schedule (15 rounds, patience 4) is shorter than the study's (50 rounds, patience 10). Nothing said
so. :func:`run_caveats` names each such setting and its remedy; the pretrain and train stages log
them as warnings and the report prints them under its tables.
"""

from __future__ import annotations

import logging

from fedhisto.config.study import Config

STUDY_MAX_ROUNDS = 50  # the study: at most 50 rounds
STUDY_PATIENCE = 10  # early stop after 10 rounds without improvement

TINY_SYNTHETIC = (
    "cohort.mode is 'real' but the frozen encoder is the tiny one pretrained on synthetic tissue only "
    "(model.encoder.name: tiny): on real LC25000 families it left validation macro-F1 at 0.556 with one class "
    "never predicted. Use a pathology foundation model (model.encoder.name: hibou-b with local_dir) or pretrain "
    "the tiny encoder self-supervised on the clients' optimisation images (model.pretrain.objective: "
    "self_supervised)")
TINY_SELF_SUPERVISED = (
    "cohort.mode is 'real' and the tiny encoder is pretrained self-supervised on the clients' optimisation images: "
    "it has seen real tissue, but it is a CPU-sized encoder (64 wide, 3 layers), not a pathology foundation model")
TINY_RANDOM = (
    "cohort.mode is 'real' and the tiny encoder is neither pretrained by the pipeline (model.pretrain.enabled: "
    "false) nor loaded from model.encoder.local_dir: its features are random")


def run_caveats(cfg: Config) -> list[str]:
    """Warnings for a real cohort meeting the tiny encoder or a schedule shorter than the study's
    (none for the synthetic cohort, whose embedded default is built around both)."""
    if cfg.cohort.mode != "real":
        return []
    out = []
    if cfg.model.encoder.name == "tiny":
        pc = cfg.model.pretrain
        if cfg.model.encoder.local_dir:
            pass  # the user's own tiny weights: nothing known about them
        elif not pc.enabled:
            out.append(TINY_RANDOM)
        else:
            out.append(TINY_SELF_SUPERVISED if pc.objective == "self_supervised" else TINY_SYNTHETIC)
    t = cfg.train
    if t.max_rounds < STUDY_MAX_ROUNDS or t.patience < STUDY_PATIENCE:
        out.append(f"train.max_rounds {t.max_rounds} / train.patience {t.patience} are below the study's "
                   f"{STUDY_MAX_ROUNDS} / {STUDY_PATIENCE} (the embedded default's short schedule): on real images "
                   "runs early-stop before the classifier has learnt every class; set train.max_rounds: 50 and "
                   "train.patience: 10")
    return out


def method_caveats(cfg: Config) -> dict[str, list[str]]:
    """``{method: [departure, ...]}`` for every method the config trains that departs from its own paper's
    assumptions (methods without a departure are absent). Builds each method (imports it)."""
    from fedhisto.methods import build_method

    out = {}
    for name in dict.fromkeys(m for m, _ in cfg.train_runs()):
        if lines := build_method(name, cfg).protocol_departures():
            out[name] = lines
    return out


def log_caveats(cfg: Config, log: logging.Logger) -> list[str]:
    """Each caveat as a WARNING in the stage's log (where Snakemake points the user); returns them."""
    caveats = run_caveats(cfg)
    for text in caveats:
        log.warning("CAVEAT: %s", text)
    return caveats
