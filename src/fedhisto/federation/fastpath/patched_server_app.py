"""The fast path's ServerApp: the stock ServerApp (``federation.server_app``), in a process whose pulls of
the replies' objects from the SuperLink retry after 0.05 s instead of Flower's 1 s (``fast_pull``).

Named by the fast path's own Flower app (``fastpath/app/pyproject.toml``, which ``fedhisto federate
--fastpath`` hands to ``flwr run``); the stock app names ``federation.server_app`` itself, which never
imports this package. Refused on a Flower the fast path is not tested against (``fastpath.require``).
"""

from __future__ import annotations

from fedhisto.federation.fastpath import require
from fedhisto.federation.fastpath.fast_pull import patch

require()
patch(("flwr.superlink.grid.http_grid",))  # the deployment Grid's pulls (the ServerApp's process only)

from fedhisto.federation.server_app import app  # noqa: E402

__all__ = ["app"]
