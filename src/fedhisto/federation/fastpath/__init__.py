"""The fast path: an opt-in that MODIFIES FLOWER'S PROCESS MODEL to make a deployment round cheap.

By default a federation runs as Flower ships it: ``flower-superlink``, ``flower-supernode`` and one
stock ``flwr-clientapp`` process per message (docs/federation.md). That process imports torch and the
model code and decodes the site's images for every message, and Flower's fixed polls (a SuperNode
sleeps 3 s when idle, an object pull retries after 1 s) add seconds per message. On the small test
cohort this makes a deployment round many times slower than the in-process engine; on rounds of
minutes (HIBOU-B at real sites) it does not matter.

``fedhisto site --fastpath`` / ``fedhisto federate --fastpath`` (``LocalFederation(fastpath=True)`` in
tests and benchmarks) swap in, at the site and at the coordinator:

- ``worker``: a long-lived site worker that runs every Flower task of its SuperNode itself (a
  re-implementation of Flower's ``run_clientapp``), so torch, the model and the site's decoded
  images are loaded once per node;
- ``clientapp_launcher``: a ``flwr-clientapp`` shim put first on the SuperNode's PATH that hands each
  task to that worker (and runs Flower's own ``flwr-clientapp`` when the worker is gone);
- ``supernode_poll``: ``flower-supernode`` with its idle poll capped at 0.2 s (and an optional
  shorter heartbeat), by patching a module of Flower's;
- ``fast_pull``: Flower's object pulls retried after 0.05 s instead of 1 s, in the SuperNode, the
  worker and the ServerApp (``fastpath.server_app``, named by this folder's own Flower app).

These reach into Flower's internals, so they are tested against exactly the Flower versions in
:data:`TESTED_FLWR` (flwr 1.42.x) and refused on any other (:func:`require`: a clear error, and the
fast-path tests skip). Nothing of the protocol (``server``, ``site``, ``handlers``, ``records``, the
Flower apps) imports this package: a reply computed here is ``handlers.handle``'s, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

TESTED_FLWR = ("1.42",)
"""The ``major.minor`` Flower series the fast path is tested against (every patch release of each)."""

APP_DIR = Path(__file__).resolve().parent / "app"
"""The Flower app a fast-path run hands to ``flwr run``: the stock app's components and run config,
with the ServerApp that shortens its pulls (``fastpath.server_app``)."""


class FastpathUnsupported(RuntimeError):
    """The installed Flower is not one the fast path is tested against."""


def flwr_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flwr")
    except PackageNotFoundError:
        return ""


def supported(flwr: str | None = None) -> bool:
    """Whether ``flwr`` (default: the installed Flower's version) is in :data:`TESTED_FLWR`."""
    v = flwr_version() if flwr is None else flwr
    return bool(v) and ".".join(v.split(".")[:2]) in TESTED_FLWR


def why_unsupported(flwr: str | None = None) -> str:
    v = flwr_version() if flwr is None else flwr
    return (f"the fast path (fedhisto.federation.fastpath) modifies Flower's process model and is tested "
            f"against flwr {', '.join(s + '.x' for s in TESTED_FLWR)} only; this environment has "
            f"{'flwr ' + v if v else 'no flwr'}. Run without --fastpath (stock Flower processes), or install "
            f"a tested Flower: pip install \"flwr>={TESTED_FLWR[0]},<{_next_minor(TESTED_FLWR[-1])}\"")


def require(flwr: str | None = None) -> None:
    """Refuse the fast path on a Flower it is not tested against."""
    if not supported(flwr):
        raise FastpathUnsupported(why_unsupported(flwr))


def _next_minor(series: str) -> str:
    major, minor = series.split(".")
    return f"{major}.{int(minor) + 1}"
