"""The manifests of the retrained experiment conditions, derived from the main pipeline's artifacts.

- ``leakage/<policy>``: clearance's families re-filed under another ``clearance.family_policy``
  (the families themselves do not depend on it) and the manifest stage run on them unchanged.
- ``leave_one_site_out/<client>``: the main manifest with the client's images (pool and holdout)
  and its sites' share of validation and test moved to the ``external`` split (validation then
  holds training sites only, as domain generalisation requires), every other member of their
  augmentation families set aside (``whole_families`` lets a family span sites) and the study's
  external cohort set aside, so the predict stage's ``external`` cohort is the left-out site.
"""

from __future__ import annotations

import csv
import logging
from collections import Counter
from pathlib import Path

from fedhisto.clearance.stage import refile
from fedhisto.config.study import Config
from fedhisto.infra.atomic import write_csv, write_json
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.manifest.stage import composition, dataset_identity, manifest_columns, run_manifest

STAGE = "experiments"
log = logging.getLogger(__name__)


class ConditionError(ValueError):
    pass


def with_policy(cfg: Config, policy: str) -> Config:
    return cfg.model_copy(update={"clearance": cfg.clearance.model_copy(update={"family_policy": policy})})


def policy_manifest(sources_csv: str | Path, families_csv: str | Path, edges_csv: str | Path, cfg: Config,
                    policy: str, out_dir: str | Path) -> dict:
    """``out_dir``: families.csv re-filed for ``policy``, then the manifest stage's own outputs."""
    out = Path(out_dir)
    with Path(families_csv).open() as fh:
        reader = csv.DictReader(fh)
        columns, rows = reader.fieldnames, list(reader)
    write_csv(out / "families.csv", refile(rows, policy), columns)
    write_sidecar(out / "families.csv", provenance_block(STAGE, {"family_policy": policy}, {"families": families_csv}))
    return run_manifest(sources_csv, out / "families.csv", edges_csv, with_policy(cfg, policy), out)


def leave_one_site_out_manifest(manifest_csv: str | Path, manifest_json: str | Path, client: str, cfg: Config,
                                out_dir: str | Path) -> dict:
    sites = set(cfg.manifest.client_sites.get(client, []))
    with Path(manifest_csv).open() as fh:
        rows = list(csv.DictReader(fh))
    if not sites or not any(r["client"] == client for r in rows):
        raise ConditionError(f"{manifest_csv}: client {client!r} has no images (manifest.client_sites: "
                             f"{cfg.manifest.client_sites.get(client)})")
    # the client's own images and its sites' share of validation and test become the test cohort;
    # under whole_families a family can span sites, so any other member of those families (another
    # client's copy, a validation relative) is set aside: nothing left to train or select on is a
    # relative of a test image
    left = {r["sample_id"] for r in rows if r["client"] == client
            or (not r["client"] and r["split"] in ("validation", "test") and r["site"] in sites)}
    families = {r["family"] for r in rows if r["sample_id"] in left}
    moved: Counter = Counter()
    relatives = 0
    out_rows = []
    for r in rows:
        r = dict(r)
        if r["sample_id"] in left:
            moved[r["split"] if not r["client"] else f"{r['client']}:{r['split']}"] += 1
            r.update(partition="external", client="", split="external")
        elif r["cohort"] == "external" or (r["family"] in families and r["split"] != "unused"):
            relatives += r["cohort"] == "internal"
            r.update(partition="unused", client="", split="unused")
        out_rows.append(r)
    out = Path(out_dir)
    prov = provenance_block(STAGE, {"left_out": client, "sites": sorted(sites)},
                            {"manifest": manifest_csv, "identity": manifest_json})
    write_csv(out / "manifest.csv", out_rows, manifest_columns(out_rows))
    write_csv(out / "composition.csv", composition(out_rows), None)
    summary = {"dataset_identity": dataset_identity(out_rows), "images": len(out_rows), "left_out": client,
               "left_out_sites": sorted(sites), "moved_to_external": dict(sorted(moved.items())),
               "external_images": sum(r["split"] == "external" for r in out_rows),
               "relatives_set_aside": relatives,
               "family_policy": cfg.clearance.family_policy, "provenance": prov}
    write_json(out / "manifest.json", summary)
    for name in ("manifest.csv", "composition.csv"):
        write_sidecar(out / name, prov)
    log.info("leave %s out: %d images of sites %s become the test cohort (%s)", client, summary["external_images"],
             sorted(sites), summary["moved_to_external"])
    return summary
