"""(Fast path) A lean ``flwr-clientapp``: hands the SuperNode's task to the site worker instead of starting Python's
whole Flower + torch stack for one message.

The SuperNode's SuperExec launches ``flwr-clientapp --runtime-api-address A --token T ...`` (found on
PATH) for every message. ``supernode_poll`` (the SuperNode ``fedhisto site --fastpath`` starts) puts a
``flwr-clientapp`` that runs this module first on PATH when a worker is configured
(``FEDHISTO_SITE_WORKER``, the worker's socket). This process imports only the standard library,
passes the token and address to the worker, which runs the task (``worker.run_task``: pull the
message from the SuperNode, handle it, push the reply, as Flower's ``run_clientapp`` does), and
exits with the worker's exit code. If the worker cannot be reached, it runs Flower's own
``flwr-clientapp`` with the same arguments (slow, but the message is still answered), and says so
on stderr (the SuperNode's log).
"""

from __future__ import annotations

import os
import sys

WORKER_VAR = "FEDHISTO_SITE_WORKER"
REAL_VAR = "FEDHISTO_REAL_FLWR_CLIENTAPP"


def _args(argv: list[str]) -> dict:
    out = {"runtime_api_address": "127.0.0.1:9094", "token": "", "insecure": False, "root_certificates": None}
    it = iter(argv)
    for a in it:
        if a in ("--runtime-api-address", "--clientappio-api-address"):
            out["runtime_api_address"] = next(it)
        elif a == "--token":
            out["token"] = next(it)
        elif a == "--root-certificates":
            out["root_certificates"] = next(it)
        elif a == "--insecure":
            out["insecure"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sock = os.environ.get(WORKER_VAR, "")
    args = _args(argv)
    if sock and args["token"]:
        from fedhisto.federation.fastpath.worker import WorkerUnavailable, call_task

        try:
            return call_task(sock, args)
        except WorkerUnavailable as exc:
            print(f"fedhisto: {exc}; running Flower's flwr-clientapp instead", file=sys.stderr, flush=True)
    real = os.environ.get(REAL_VAR) or os.path.join(os.path.dirname(sys.executable), "flwr-clientapp")
    os.execv(real, [real, *argv])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
