"""Test support for the Flower engine: a small prepared cohort, and a Grid that calls the ClientApp in
this process (no Ray, no SuperLink) so the message path is tested in seconds."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import yaml

from fedhisto.cohort import run_cohort
from fedhisto.config import CohortConfig, PlantedFamilies, SyntheticCohort, load_config
from fedhisto.manifest import run_manifest
from fedhisto.stain import run_stain

TINY = {"model": {"encoder": {"name": "tiny", "require_pretrained": False}, "adapter_hidden": 16, "film_hidden": 16},
        "views": {"crop_size": 48}, "train": {"max_rounds": 2, "patience": 10, "lr": 1e-3}}
SITES = ["C1", "C2", "C3", "C4", "C5"]


def prepare(root: Path) -> dict:
    """A rendered small cohort, a manifest of its originals and stain descriptors (as tests/test_train.py)."""
    cohort = CohortConfig(synthetic=SyntheticCohort(planted=PlantedFamilies(families_per_site=0)))
    run_cohort(cohort, root / "cohort", threads=2)
    from fedhisto.clearance.stage import FAMILY_COLUMNS
    from fedhisto.sources import read_sources_csv

    rows = read_sources_csv(root / "cohort/sources.csv")
    with (root / "families.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FAMILY_COLUMNS)
        w.writeheader()
        for k, r in enumerate(rows):
            w.writerow({"relpath": r.relpath, "path": r.path, "label": r.label, "site": r.site, "cohort": r.cohort,
                        "sha256": f"s{k}", "family": f"f{k}", "family_size": 1, "representative": True, "keep": True})
    (root / "edges.csv").write_text("a,b,stage,score,threshold,decision\n")
    cfg = load_config(TINY)
    run_manifest(root / "cohort/sources.csv", root / "families.csv", root / "edges.csv", cfg, root / "manifest")
    run_stain(root / "manifest/manifest.csv", cfg, root / "stain")
    (root / "config.yaml").write_text(yaml.safe_dump(TINY))
    return {"root": root, "cfg": cfg, "config": root / "config.yaml", "manifest": root / "manifest/manifest.csv",
            "identity": root / "manifest/manifest.json", "descriptors": root / "stain/descriptors.json",
            "images": root / "cohort"}


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
