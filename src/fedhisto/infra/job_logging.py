"""Logging of a stage job: to stderr and to its rule's log, with an uncaught error written where Snakemake
points the user."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any


def setup_logging(log_path: str | None = None, append: bool = False) -> None:
    """Log to stderr and, if given, to ``log_path`` (truncated, unless ``append``: a warm child continues the
    log its job process began, :mod:`fedhisto.infra.warm_server`)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path, mode="a" if append else "w"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=handlers, force=True)
    from fedhisto.infra.progress import silence_library_bars_off_terminal

    silence_library_bars_off_terminal()  # e.g. transformers' "Writing model shards" in a piped log
    sys.excepthook = _log_uncaught  # a stage's error lands in its rule's log, where Snakemake points the user


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("fedhisto").error("stage failed: %s: %s", kind.__name__, exc, exc_info=(kind, exc, tb))
