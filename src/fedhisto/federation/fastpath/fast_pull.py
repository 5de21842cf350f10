"""(Fast path) Flower's object pulls, retried after 0.05 s instead of 1 s when an object has not arrived yet.

Every hop of a Flower 1.42 message pulls the message's objects (``pull_objects`` in
``flwr/supercore/inflatable/inflatable_utils.py``): the SuperNode from the SuperLink, the ClientApp
(here: the site worker's ``run_task``) from its SuperNode, the ServerApp the replies from the
SuperLink. A hop often asks before the previous hop has stored the objects (the SuperExec starts the
task while its SuperNode is still pulling), gets ``ObjectUnavailableError`` and retries after
Flower's fixed backoff: 1 s, then 2, 4 ... capped at 10 s (``PULL_INITIAL_BACKOFF``,
``PULL_BACKOFF_CAP``, not configurable). Measured in the round benchmark: a site worker's
``pull_task_input`` took 1.2 or 3.3 s for a message of a few hundred kB (one or two backoffs),
against 0.06 s when the objects were there. :func:`patch` makes the pulls of one process retry
after 0.05 s, doubling up to 0.5 s (``FEDHISTO_PULL_BACKOFF_S``, ``FEDHISTO_PULL_BACKOFF_CAP_S``),
bounded by Flower's own total time (``PULL_MAX_TIME``, 7200 s) rather than its 500 tries (which
at a 0.5 s cap would end after ~4 minutes instead of Flower's ~80). Nothing else about a pull
changes: the same requests, the same objects, the same errors when an object never comes.

Used by the fast path only (``fedhisto site --fastpath``'s SuperNode and worker, the fast path's
ServerApp ``fastpath.server_app``); stock Flower processes keep Flower's pulls.
"""

from __future__ import annotations

import importlib
import os

BACKOFF_VAR, CAP_VAR = "FEDHISTO_PULL_BACKOFF_S", "FEDHISTO_PULL_BACKOFF_CAP_S"


def patch(modules: tuple[str, ...] = ()) -> None:
    """Shorter retries for ``pull_objects`` in Flower's inflatable utilities (which
    ``pull_and_inflate_object_from_tree`` calls) and in each of ``modules`` that imported it by name."""
    import flwr.supercore.inflatable.inflatable_utils as iu

    real = getattr(iu.pull_objects, "flower_pull_objects", iu.pull_objects)
    initial = float(os.environ.get(BACKOFF_VAR, "0.05"))
    cap = float(os.environ.get(CAP_VAR, "0.5"))

    def pull_objects(object_ids, pull_object_fn, **kwargs):
        kwargs["initial_backoff"] = min(float(kwargs.get("initial_backoff", iu.PULL_INITIAL_BACKOFF)), initial)
        kwargs["backoff_cap"] = min(float(kwargs.get("backoff_cap", iu.PULL_BACKOFF_CAP)), cap)
        kwargs["max_tries_per_object"] = None  # bounded by max_time (Flower's PULL_MAX_TIME) instead
        return real(object_ids, pull_object_fn, **kwargs)

    pull_objects.flower_pull_objects = real  # type: ignore[attr-defined]
    iu.pull_objects = pull_objects
    for name in modules:
        module = importlib.import_module(name)
        current = getattr(module, "pull_objects", None)
        if current is None or not (current is real or hasattr(current, "flower_pull_objects")):
            raise RuntimeError(f"{name} has no pull_objects of Flower's to shorten (Flower changed?)")
        module.pull_objects = pull_objects
