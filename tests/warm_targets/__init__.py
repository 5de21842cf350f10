"""Targets the warm server's children run in tests/test_warm.py (on the server's PYTHONPATH)."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path


def describe(marker: str) -> dict:
    import torch

    print(f"stdout from the child {marker}", flush=True)
    logging.getLogger("fedhisto.test").info("log line from the child %s", marker)
    return {"pid": os.getpid(), "cwd": os.getcwd(), "env": os.environ.get("WARM_TEST_VALUE"),
            "draw": torch.rand(3).tolist(), "threads": torch.get_num_threads(), "argv_ok": bool(sys.argv)}


def fail(message: str) -> None:
    raise ValueError(message)


def config_dump(cfg) -> str:
    return cfg.model_dump_json()


def sleep_forever(pid_file: str) -> None:
    Path(pid_file).write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)


def grow_then_get_killed(megabytes: int) -> None:
    """Touch ``megabytes`` of memory, then die as the kernel's out-of-memory killer ends a process."""
    import signal

    block = bytearray(megabytes << 20)
    block[:: 4096] = b"\x01" * len(block[:: 4096])  # every page resident
    os.kill(os.getpid(), signal.SIGKILL)
