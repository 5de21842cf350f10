"""Secure aggregation on the run's device (tests/fake_device.py): the in-process masked sums are formed on the
host (the quantised field arithmetic is NumPy's), and what the server step makes of them, the members and a
method's server state, must be back on the run's device, as without secure aggregation; a run killed after a
round resumes from its checkpoint (plain data, read with ``weights_only``) and ends bitwise where the
uninterrupted run does, the stochastic rounding's draws replayed from the run's stream.

fedavg_peft is the product form (delta-SVD of the summed s B_k A_k), past_v2 takes its weights from a first
masked sum of the statistics and sums the prototypes after aggregation, fedadam keeps server moments."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, train
from fake_device import DEVICE, fake_device, on_device

import fedhisto.model.build
import fedhisto.predict.stage
import fedhisto.train.stage
from fedhisto.entry import study_config

METHODS = ("fedavg_peft", "past_v2", "fedadam")


def _cfg(method: str):
    raw = copy.deepcopy(TINY)
    raw["train"].update(max_rounds=2, methods=[method], ablations=[], ablation_seeds=[])
    raw["secure_aggregation"] = {"enabled": True}
    return study_config(raw)


def _checkpoint(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)


@pytest.mark.parametrize("method", METHODS)
def test_a_secure_run_stays_on_its_device_and_resumes_there(prepared, tmp_path, monkeypatch, method):
    for module in (fedhisto.model.build, fedhisto.train.stage, fedhisto.predict.stage):
        monkeypatch.setattr(module, "pick_device", lambda *args, **kwargs: DEVICE)
    cfg = _cfg(method)
    seen: list[dict] = []

    def record(ckpt: dict) -> None:  # after every round's checkpoint: where the driver's states live
        seen.append({"round": ckpt["round"], "members": on_device(ckpt["members"]),
                     "server": None if ckpt["server_state"] is None else on_device(ckpt["server_state"]),
                     "secure": "secure_aggregation" in ckpt["history"][-1]})

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    with fake_device() as mode:
        train(prepared, method, reference, cfg=cfg, after_round=record)
        with pytest.raises(KeyboardInterrupt):
            train(prepared, method, killed, cfg=cfg, stop_after_round=1)
        train(prepared, method, killed, cfg=cfg, after_round=record)
    assert mode.mixed == [], mode.mixed[:3]
    assert json.loads((killed / "report.json").read_text())["resumed_at_rounds"] == [1]
    assert [s["round"] for s in seen] == [1, 2, 2] and all(s["secure"] for s in seen), seen
    assert all(s["members"] for s in seen), seen  # the server step's members are on the run's device
    if method == "fedadam":  # its moments are computed from the unmasked sum on the device
        assert all(s["server"] for s in seen), seen
    ref, res = _checkpoint(reference), _checkpoint(killed)
    assert ref["history"][-1]["secure_aggregation"] == res["history"][-1]["secure_aggregation"]
    for member in ref["members"]:
        a, b = ref["members"][member], res["members"][member]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), member
