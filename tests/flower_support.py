"""Test support for the Flower engine: a small prepared cohort, and a Grid that calls the ClientApp in
this process (no Ray, no SuperLink) so the message path is tested in seconds."""

from __future__ import annotations

import itertools
from pathlib import Path

from conftest import prepare_cohort

TINY = {"model": {"encoder": {"name": "tiny", "require_pretrained": False}, "adapter_hidden": 16, "film_hidden": 16},
        "views": {"crop_size": 48}, "train": {"max_rounds": 2, "patience": 10, "lr": 1e-3}}
SITES = ["C1", "C2", "C3", "C4", "C5"]


def prepare(root: Path) -> dict:
    """The training tests' small prepared cohort (conftest.prepare_cohort), two rounds."""
    return prepare_cohort(root, TINY)


class LocalGrid:
    """The part of ``flwr.serverapp.Grid`` the ServerApp uses, delivering to the ClientApp in-process.
    ``node_config`` per node as a SuperNode's ``--node-config``; ``down``: node ids that never answer."""

    def __init__(self, node_configs: dict[int, dict], run_config: dict, named: bool = True):
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        self.node_configs, self.run_config, self.named = node_configs, run_config, named
        self.down: set[int] = set()
        self._ids = itertools.count(1)

    def get_nodes(self):
        from types import SimpleNamespace

        return [SimpleNamespace(node_id=nid, name=str(nc.get("site-id", "")) if self.named else "")
                for nid, nc in self.node_configs.items()]

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Context, RecordDict

        from fedhisto.federation.client_app import app

        replies = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"
            nid = m.metadata.dst_node_id
            if nid in self.down:
                continue
            ctx = Context(run_id=1, node_id=nid, node_config=self.node_configs[nid], state=RecordDict(),
                          run_config=self.run_config)
            replies.append(app(m, ctx))
        return replies
