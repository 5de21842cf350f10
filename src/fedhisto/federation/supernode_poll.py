"""``flower-supernode`` with a shorter idle poll: a message waits ~0.1 s at the SuperNode instead of ~1.5 s.

Flower 1.42's SuperNode asks the SuperLink for a message, and when there is none sleeps a fixed 3 s
(``time.sleep(3)`` in ``flwr/supernode/start_client_internal.py``, not configurable), and waits for a
ClientApp's reply in 0.5 s steps. Every message of a round therefore waits on average 1.5 s before a
site even sees it. This entry point caps those sleeps at ``FEDHISTO_SUPERNODE_POLL_S`` seconds
(default 0.2) by giving that one module a ``time`` whose ``sleep`` is capped, then runs Flower's own
``flower-supernode`` main with the same arguments: nothing else about the SuperNode changes (TLS,
authentication, heartbeats, the SuperExec it launches). The cost is more idle requests to the
SuperLink (five per second per site at 0.2 s). Its pulls of a message's objects from the SuperLink
retry after 0.05 s instead of Flower's 1 s (``fast_pull``).

The SuperExec the SuperNode launches polls for tasks every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``
seconds (Flower's own setting, default 1.0); ``deploy.flower_env`` sets it to 0.1.

``--site-worker SOCKET`` (ours, removed before Flower parses the rest): the SuperExec then finds a
``flwr-clientapp`` first on PATH that hands each task to the site's worker
(``clientapp_launcher``), so a message costs no new Python + Flower + torch process.
"""

from __future__ import annotations

import os
import sys
import time as _time

POLL_VAR = "FEDHISTO_SUPERNODE_POLL_S"


class CappedClock:
    """The ``time`` module with ``sleep`` capped at ``cap`` seconds."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __getattr__(self, name: str):
        return getattr(_time, name)

    def sleep(self, seconds: float) -> None:
        _time.sleep(min(seconds, self.cap))


def patch(cap: float) -> None:
    import flwr.supernode.start_client_internal as loop

    loop.time = CappedClock(cap)  # type: ignore[assignment]


def use_worker(socket_path: str) -> None:
    """A ``flwr-clientapp`` first on PATH (for the SuperExec this process starts) that goes to the worker."""
    from pathlib import Path

    from fedhisto.federation.clientapp_launcher import REAL_VAR, WORKER_VAR

    real = str(Path(sys.executable).parent / "flwr-clientapp")
    bin_dir = Path(socket_path).resolve().parent / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    launcher = bin_dir / "flwr-clientapp"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fedhisto.federation.clientapp_launcher "$@"\n')
    launcher.chmod(0o755)
    os.environ.update({WORKER_VAR: str(Path(socket_path).resolve()), REAL_VAR: real,
                       "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"})


def main() -> None:
    argv = sys.argv[1:]
    if "--site-worker" in argv:
        i = argv.index("--site-worker")
        use_worker(argv[i + 1])
        del argv[i:i + 2]
    patch(float(os.environ.get(POLL_VAR, "0.2")))
    from fedhisto.federation.fast_pull import patch as fast_pulls

    fast_pulls(("flwr.supernode.start_client_internal",))  # its pulls from the SuperLink retry after 0.05 s
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *argv]
    flower_supernode()


if __name__ == "__main__":
    main()
