"""Site holdouts large enough to score a site: the embedded default gives each client 30 holdout images, drawn
from its pool, while its optimisation sets stay those of the `small` profile (the same training)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from test_manifest import write_corpus

from fedhisto import CLASSES
from fedhisto.config.study import ConfigError, load_config, load_config_file
from fedhisto.manifest.stage import build_manifest
from fedhisto.manifest.targets import scale

REPO = Path(__file__).resolve().parents[1]
CLIENTS = ("C1", "C2", "C3", "C4", "C5")


def counts(rows: list[dict], split: str) -> dict[str, tuple[int, int, int]]:
    c = Counter((r["client"], r["label"]) for r in rows if r["split"] == split)
    return {k: tuple(c[(k, cls)] for cls in CLASSES) for k in CLIENTS}


def test_every_site_of_the_embedded_default_holds_out_thirty_images_and_trains_on_smalls_sets(tmp_path: Path):
    cfg = load_config_file(REPO / "config/config.yaml")
    (tmp_path / "default").mkdir()
    (tmp_path / "small").mkdir()
    rows, info = build_manifest(*write_corpus(tmp_path / "default", cfg.cohort.synthetic.profile)[:2], cfg)
    small_rows, _ = build_manifest(*write_corpus(tmp_path / "small", "small")[:2], load_config({}))
    holdout = counts(rows, "holdout")
    assert holdout == {"C1": (10, 9, 11), "C2": (13, 12, 5), "C3": (8, 8, 14), "C4": (5, 5, 20), "C5": (12, 18, 0)}
    assert all(sum(h) >= 30 for h in holdout.values())
    # every class a site has is in its holdout: C4's used to be its three SCC images alone
    assert all(h[c] >= 5 for k, h in holdout.items() for c in range(3) if k != "C5" or c != 2)
    # the same training: each client's optimisation set is as large, class by class, as under `small`, whose
    # 10 % (C5: 15 %) holdouts were the 3, 4, 4, 3 and 10 images the worst-client column could not resolve
    assert counts(rows, "optimisation") == counts(small_rows, "optimisation")
    assert {k: sum(v) for k, v in counts(small_rows, "holdout").items()} == {"C1": 3, "C2": 4, "C3": 4, "C4": 3, "C5": 10}
    assert info["targets"]["holdouts"]["C4"] == [5, 5, 20]


def test_the_communication_accounting_sees_the_same_optimisation_sizes():
    from fedhisto.accounting.stage import optimisation_sizes

    default = optimisation_sizes(load_config_file(REPO / "config/config.yaml"))
    assert default == optimisation_sizes(load_config({})) == {"C1": 34, "C2": 42, "C3": 30, "C4": 31, "C5": 54}


@pytest.mark.parametrize(("holdouts", "words"), [
    ({"C1": (1, 1, 1)}, ["targets.holdouts names clients ['C1']", "give every client's holdout, or none"]),
    ({k: (1, 1, 1) for k in CLIENTS} | {"C4": (0, 0, 2)}, ["targets.holdouts.C4 SCC: 2 of a pool of 2"]),
    ({k: (1, 1, 1) for k in CLIENTS} | {"C5": (1, 1, 1)}, ["targets.holdouts.C5 SCC: 1 of a pool of 0"]),
])
def test_holdouts_that_do_not_fit_their_pools_are_refused_by_key(holdouts, words):
    targets = {"clients": {k: (3, 3, 2) for k in CLIENTS[:4]} | {"C5": (3, 3, 0)}, "validation": (1, 1, 1),
               "test": (1, 1, 1), "holdouts": holdouts}
    with pytest.raises(ConfigError) as err:
        load_config({"cohort": {"mode": "real", "real": {"sources": []}}, "manifest": {"targets": targets}})
    for w in words:
        assert w in str(err.value)


def test_scaled_targets_scale_the_holdouts_and_leave_an_optimisation_image():
    targets = load_config_file(REPO / "config/config.yaml").partition_targets()
    half = scale(targets, 0.5)
    assert half.holdouts["C1"] == (5, 4, 5) and half.clients["C1"] == (10, 9, 12)
    from fedhisto.config.study import PartitionTargets

    near = PartitionTargets(clients={"C1": (10, 10, 10)}, holdouts={"C1": (9, 5, 0)}, validation=(1, 1, 1),
                            test=(1, 1, 1))
    # floor(9 x 0.15) = floor(10 x 0.15) = 1 would hold out the pool's one image: one is left to train on
    assert scale(near, 0.15).holdouts["C1"] == (0, 0, 0) and scale(near, 0.15).clients["C1"] == (1, 1, 1)
