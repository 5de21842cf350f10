"""(Fast path) ``flower-supernode`` with a shorter idle poll: a message waits ~0.1 s at the SuperNode instead of ~1.5 s.

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
seconds (Flower's own setting, default 1.0); ``deploy.flower_env`` sets it to 0.1 (stock
and fast path alike: it is Flower's documented setting).

``--site-worker SOCKET`` (ours, removed before Flower parses the rest): the SuperExec then finds a
``flwr-clientapp`` first on PATH that hands each task to the site's worker
(``fastpath.clientapp_launcher``), so a message costs no new Python + Flower + torch process.

``FEDHISTO_SUPERNODE_HEARTBEAT_S`` (unset: Flower's fixed 30 s) sets the interval the SuperNode
announces and keeps between its heartbeats. The SuperLink declares a node gone after two intervals
without one (``HEARTBEAT_PATIENCE``), and only then answers its pending messages with
``NODE_UNAVAILABLE``; at 10 s (the SuperLink's minimum) a round learns of a dead site after 16-20 s
instead of 40-60 s, for one small request every 4 s.
"""

from __future__ import annotations

import os
import sys
import time as _time

POLL_VAR = "FEDHISTO_SUPERNODE_POLL_S"
HEARTBEAT_VAR = "FEDHISTO_SUPERNODE_HEARTBEAT_S"


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


def set_heartbeat(seconds: float) -> None:
    """The SuperNode's heartbeat interval: what it announces to the SuperLink (``fleet_http_connection``)
    and what its sender waits between heartbeats (``supercore.heartbeat``), both Flower's fixed
    ``HEARTBEAT_DEFAULT_INTERVAL`` read at call time. Refused outside the SuperLink's accepted range."""
    import flwr.supercore.heartbeat as sender
    import flwr.supernode.fleet_http_connection as connection
    from flwr.common.constant import HEARTBEAT_MAX_INTERVAL, HEARTBEAT_MIN_INTERVAL

    if not HEARTBEAT_MIN_INTERVAL <= seconds <= HEARTBEAT_MAX_INTERVAL:
        raise ValueError(f"{HEARTBEAT_VAR}={seconds:g}: the SuperLink accepts heartbeat intervals in "
                         f"[{HEARTBEAT_MIN_INTERVAL}, {HEARTBEAT_MAX_INTERVAL}] s")
    sender.HEARTBEAT_DEFAULT_INTERVAL = connection.HEARTBEAT_DEFAULT_INTERVAL = seconds  # type: ignore[attr-defined]


def use_worker(socket_path: str) -> None:
    """A ``flwr-clientapp`` first on PATH (for the SuperExec this process starts) that goes to the worker."""
    from pathlib import Path

    from fedhisto.federation.fastpath.clientapp_launcher import REAL_VAR, WORKER_VAR

    real = str(Path(sys.executable).parent / "flwr-clientapp")
    bin_dir = Path(socket_path).resolve().parent / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    launcher = bin_dir / "flwr-clientapp"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fedhisto.federation.fastpath.clientapp_launcher "$@"\n')
    launcher.chmod(0o755)
    os.environ.update({WORKER_VAR: str(Path(socket_path).resolve()), REAL_VAR: real,
                       "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"})


def main() -> None:
    from fedhisto.federation.fastpath import FastpathUnsupported, require

    try:
        require()  # the patches below name Flower 1.42's internals
    except FastpathUnsupported as exc:
        raise SystemExit(f"fedhisto fast SuperNode: {exc}") from None
    argv = sys.argv[1:]
    if "--site-worker" in argv:
        i = argv.index("--site-worker")
        use_worker(argv[i + 1])
        del argv[i:i + 2]
    patch(float(os.environ.get(POLL_VAR, "0.2")))
    if os.environ.get(HEARTBEAT_VAR):
        set_heartbeat(float(os.environ[HEARTBEAT_VAR]))
    from fedhisto.federation.fastpath.fast_pull import patch as fast_pulls

    fast_pulls(("flwr.supernode.start_client_internal",))  # its pulls from the SuperLink retry after 0.05 s
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *argv]
    flower_supernode()


if __name__ == "__main__":
    main()
