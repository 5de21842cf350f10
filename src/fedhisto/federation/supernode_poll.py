"""``flower-supernode`` with a shorter idle poll: a message waits ~0.1 s at the SuperNode instead of ~1.5 s.

Flower 1.42's SuperNode asks the SuperLink for a message, and when there is none sleeps a fixed 3 s
(``time.sleep(3)`` in ``flwr/supernode/start_client_internal.py``, not configurable), and waits for a
ClientApp's reply in 0.5 s steps. Every message of a round therefore waits on average 1.5 s before a
site even sees it. This entry point caps those sleeps at ``FEDHISTO_SUPERNODE_POLL_S`` seconds
(default 0.2) by giving that one module a ``time`` whose ``sleep`` is capped, then runs Flower's own
``flower-supernode`` main with the same arguments: nothing else about the SuperNode changes (TLS,
authentication, heartbeats, the SuperExec it launches). The cost is more idle requests to the
SuperLink (five per second per site at 0.2 s).

The SuperExec the SuperNode launches polls for tasks every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``
seconds (Flower's own setting, default 1.0); ``deploy.flower_env`` sets it to 0.1.
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


def main() -> None:
    patch(float(os.environ.get(POLL_VAR, "0.2")))
    from flwr.supernode.cli import flower_supernode

    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
