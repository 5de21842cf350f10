"""Glue shared by the thin entry scripts in ``scripts/``: logging and config from Snakemake or argv."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from fedhisto.config import Config, load_config, load_config_file


def setup_logging(log_path: str | None = None, append: bool = False) -> None:
    """Log to stderr and, if given, to ``log_path`` (truncated, unless ``append``: a warm child continues the
    log its job process began, :mod:`fedhisto.warm`)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path, mode="a" if append else "w"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=handlers, force=True)
    from fedhisto.progress import silence_library_bars_off_terminal

    silence_library_bars_off_terminal()  # e.g. transformers' "Writing model shards" in a piped log
    sys.excepthook = _log_uncaught  # a stage's error lands in its rule's log, where Snakemake points the user


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("fedhisto").error("stage failed: %s: %s", kind.__name__, exc, exc_info=(kind, exc, tb))


def log_of(smk: Any) -> str | None:
    """The rule's log file, if it declares one."""
    return smk.log[0] if len(smk.log) else None


def from_snakemake(smk: Any) -> Config:
    """Typed config from a Snakemake ``snakemake`` object, with the rule's log set up and no live progress
    bars (jobs running side by side share one stderr; each step logs one line instead)."""
    from fedhisto.progress import disable_bars

    disable_bars()
    setup_logging(log_of(smk))
    return load_config(dict(smk.config), source="snakemake config")


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
    return load_config_file(args.config), args
