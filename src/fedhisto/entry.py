"""Glue shared by the thin entry scripts in ``scripts/``: logging and config from Snakemake or argv."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from fedhisto.config.study import Config, ConfigError, command_line_config, load_config
from fedhisto.infra.job_logging import setup_logging


def study_config(raw: dict[str, Any] | None, source: str = "config") -> Config:
    """A run's config: :func:`fedhisto.config.study.load_config`, then the checks that need the methods
    themselves, which the torch-free config package cannot make: with ``privacy.enabled``, the DP
    wrapper's own refusals (:func:`fedhisto.train.private.check_privacy`: the engine, each method's
    objective, the budget, by name; the wrapper refuses the same way when a run starts), and with
    ``secure_aggregation.enabled`` every method must declare a server step over sums
    (:func:`fedhisto.methods.secure_capability.check_secure`). Every entry point a user starts a run
    from (the Snakefiles, ``fedhisto check-config``, the stage scripts, the Flower apps) builds its
    config here, so a refused configuration stops before any job runs."""
    cfg = load_config(raw, source=source)
    if cfg.privacy.enabled:
        from fedhisto.train.private import check_privacy

        try:
            check_privacy(cfg)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    if cfg.secure_aggregation.enabled:  # each method's own declaration (methods.secure_capability)
        from fedhisto.methods.secure_capability import check_secure

        try:
            check_secure(cfg)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return cfg


def study_config_file(path: str | Path, *more: str | Path) -> Config:
    """:func:`study_config` of config files laid in order, as on Snakemake's command line."""
    paths = [path, *more]
    return study_config(command_line_config(paths), source=" + ".join(map(str, paths)))


def log_of(smk: Any) -> str | None:
    """The rule's log file, if it declares one."""
    return smk.log[0] if len(smk.log) else None


def from_snakemake(smk: Any) -> Config:
    """Typed config from a Snakemake ``snakemake`` object, with the rule's log set up and no live progress
    bars (jobs running side by side share one stderr; each step logs one line instead)."""
    from fedhisto.infra.progress import disable_bars

    disable_bars()
    setup_logging(log_of(smk))
    # the GPUs the rule declares: a job that declares one and finds none stops (model.build.pick_device)
    os.environ["FEDHISTO_JOB_GPUS"] = str(int(smk.resources.get("gpu", 0) or 0))
    return study_config(dict(smk.config), source="snakemake config")


def from_argv(description: str, argv: list[str] | None = None, **extra: str) -> tuple[Config, argparse.Namespace]:
    """Parse ``--config`` plus the script's own ``--NAME`` options (``extra``: name -> help)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default="config/config.yaml", help="YAML config (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log", default=None, help="also write the log here")
    for name, help_text in extra.items():
        parser.add_argument(f"--{name}", required=True, help=help_text)
    args = parser.parse_args(argv)
    setup_logging(args.log)
    return study_config_file(args.config), args
