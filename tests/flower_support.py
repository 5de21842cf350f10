"""Test support for the Flower engine: a small prepared cohort, and a Grid that calls the ClientApp in
this process (no Ray, no SuperLink) so the message path is tested in seconds."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from conftest import TINY as CONFTEST_TINY
from conftest import prepare_cohort

from fedhisto.federation.fastpath import supported as fastpath_supported
from fedhisto.federation.fastpath import why_unsupported as fastpath_why_unsupported

# the fast path patches Flower's internals: tested on the Flower versions it names, skipped on any other
needs_fastpath = pytest.mark.skipif(not fastpath_supported(), reason=fastpath_why_unsupported())

# The training tests' config (conftest.TINY: its cohort, encoder and head) with two rounds, sequential: the
# in-process reference trains each site alone, as every Flower site does (the batched engine draws dropout
# masks once for the stacked clients, so it is not bitwise the same)
TINY = {**CONFTEST_TINY, "train": {**CONFTEST_TINY["train"], "max_rounds": 2, "engine": "sequential"}}
SITES = ["C1", "C2", "C3", "C4", "C5"]


def prepare(root: Path) -> dict:
    """The training tests' small prepared cohort (conftest.prepare_cohort), two rounds."""
    return prepare_cohort(root, TINY)


class LocalGrid:
    """The part of ``flwr.serverapp.Grid`` the ServerApp uses, delivering to the ClientApp in-process.
    ``node_config`` per node as a SuperNode's ``--node-config``; ``down``: node ids that never answer.
    A node config with ``worker`` (a fast-path site worker's socket; not a SuperNode key) hands that
    node's messages to the worker instead (``fastpath.worker.forward``)."""

    def __init__(self, node_configs: dict[int, dict], run_config: dict, named: bool = True):
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        self.node_configs, self.run_config, self.named = node_configs, run_config, named
        self.down: set[int] = set()
        self._ids = itertools.count(1)
        self.states: dict[int, object] = {}  # each node's Context.state, kept between messages as a SuperNode does
        self.on_message = None  # tests: called with each message before delivery (e.g. to take a node down)

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
            if self.on_message is not None:
                self.on_message(m)
            if nid in self.down:
                continue
            node_config = self.node_configs[nid]
            if node_config.get("worker"):
                from flwr.app import Message

                from fedhisto.federation.fastpath.worker import forward

                content = forward(str(node_config["worker"]), m.metadata.message_type, m.content,
                                  {k: v for k, v in node_config.items() if k != "worker"}, self.run_config)
                replies.append(Message(content, reply_to=m))
                continue
            from fedhisto.federation.envelope import seal, unseal

            m.content = unseal(seal(m.content))  # a copy, as the wire gives each node its own (Flower's mods mutate it)
            ctx = Context(run_id=1, node_id=nid, node_config=node_config,
                          state=self.states.setdefault(nid, RecordDict()), run_config=self.run_config)
            replies.append(app(m, ctx))
        return replies


# five clients and three evaluation sites, each with its own folder (the site-local deployment test)
SITE_FOLDERS = {"C1": ("site1", 3), "C2": ("site2", 3), "C3": ("site3", 3), "C4": ("site4", 3), "C5": ("site5", 3),
                "VAL": ("site1", 2), "TEST": ("site2", 1), "EXT": ("external", 1)}  # (rendering style, per class)
ROLES = {"VAL": "validation", "TEST": "test", "EXT": "external"}
SITE_LOCAL = {**TINY, "clearance": {"n_features": 100}, "stain": {"max_images_per_client": 6, "min_tissue_pixels": 50},
              # a third of each client's 3 images per class is its holdout: one per class, two to train on
              "manifest": {"holdout_fraction": dict.fromkeys(("C1", "C2", "C3", "C4", "C5"), 0.34)}}


def render_site_folders(root: Path) -> dict[str, Path]:
    """One folder per site (``ACA``/``Normal``/``SCC`` below it) of synthetic originals in the site's
    style: per class 3 images at each client (``SITE_LOCAL``'s holdout fraction puts one in its
    holdout), 2 at the validation site, 1 at the test and external sites."""
    from fedhisto import CLASSES
    from fedhisto.config.study import SyntheticCohort
    from fedhisto.synth.embedded_cohort import Member, render_original

    cfg = SyntheticCohort(image_size=96, external_image_size=96)
    key, out = 0, {}
    for site, (style, n) in SITE_FOLDERS.items():
        folder = root / f"{site.lower()}_images"
        for cls in CLASSES:
            for i in range(n):
                path = folder / cls / f"{cls.lower()}{i:02d}.jpeg"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(render_original(Member(style, cls, 7000 + key), cfg))
                key += 1
        out[site] = folder
    return out
