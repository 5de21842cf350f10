"""A site worker's warm-up (the fast path's site worker; issue 24, cold start): the encoder, the site's images and the run's model are
loaded before the worker says ready; the messages after it build and decode nothing, and their
replies are an unwarmed run's bit for bit. A restarted worker reads the encoder file and the decoded
images from the node's cache instead of building or decoding."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from flower_support import SITES, LocalGrid, needs_fastpath, prepare

import fedhisto.federation.site as site_mod
from fedhisto.config.study import load_config_file

pytestmark = pytest.mark.flower
RUN = ("past_v2", 11)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict:
    p = prepare(tmp_path_factory.mktemp("warm"))
    p["dataset_identity"] = json.loads(p["identity"].read_text())["dataset_identity"]
    return p


def node_configs(prepared: dict, extra=lambda site: {}) -> dict[int, dict]:
    return {100 + k: {"site-id": s, "manifest": str(prepared["manifest"]), "descriptors": str(prepared["descriptors"]),
                      **extra(s)} for k, s in enumerate(SITES)}


def flower_run(prepared: dict, out: Path, configs: dict[int, dict]) -> list[dict]:
    """The ServerApp's run over an in-process Grid; every reply's ``info`` record, in order."""
    from fedhisto.federation.server import FederatedRun
    from fedhisto.federation.server_app import GridExchange

    fed = FederatedRun(load_config_file(prepared["config"]), RUN[0], RUN[1], SITES, out, prepared["dataset_identity"],
                       str(prepared["descriptors"]))
    ex = GridExchange(LocalGrid(configs, {}), SITES, 120, 5, {"method": RUN[0], "seed": RUN[1], "config": fed.cfg_json})
    ckpt = fed.run(ex)
    fed.finalise(ex, ckpt)
    return [info for h in ckpt["history"] for ph in h["phases"].values() for info in ph["sites"].values()]


def assert_same_run(a: Path, b: Path) -> None:
    ca, cb = (torch.load(p / "checkpoint.pt", map_location="cpu", weights_only=False) for p in (a, b))
    assert ca["round"] == cb["round"] == 2
    for key in ("members", "best"):
        sa = ca[key]["members"]["global"] if key == "best" else ca[key]["global"]
        sb = cb[key]["members"]["global"] if key == "best" else cb[key]["global"]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), key
    assert [h["val_macro_f1"] for h in ca["history"]] == [h["val_macro_f1"] for h in cb["history"]]
    assert (a / "validation_predictions.csv").read_text() == (b / "validation_predictions.csv").read_text()


def test_messages_after_warm_up_build_nothing_and_equal_an_unwarmed_run(prepared: dict, tmp_path: Path, monkeypatch):
    """In one process (the in-process Grid): unwarmed, then with every site warmed up first."""
    from fedhisto.federation.site import SiteConfig, warm_up

    def fresh() -> None:
        for name in ("_MODELS", "_ENCODERS", "_DATA"):
            monkeypatch.setattr(site_mod, name, {})
        for key in site_mod.BUILT:  # in place: handlers holds the same dict
            monkeypatch.setitem(site_mod.BUILT, key, 0)

    fresh()
    cold = flower_run(prepared, tmp_path / "cold", node_configs(prepared))
    assert cold[0]["models_built"] == 1 and cold[0]["images_decoded"] > 0  # the first message paid for them

    fresh()
    cfg = load_config_file(prepared["config"])
    for nc in node_configs(prepared).values():
        splits = ("optimisation", "validation") if nc["site-id"] == SITES[0] else ("optimisation",)
        done = warm_up(SiteConfig.from_node_config(nc, {}), cfg, splits, (RUN,))
        assert all(isinstance(v, float) for v in done.values()), done
    warmed = dict(site_mod.BUILT)
    assert warmed["encoders_built"] == 1 and warmed["models_built"] == 1  # one process: the sites share them
    warm = flower_run(prepared, tmp_path / "warm", node_configs(prepared))
    assert warm and all({k: i[k] for k in warmed} == warmed for i in warm)  # no message built or decoded
    assert_same_run(tmp_path / "cold", tmp_path / "warm")


@needs_fastpath
def test_warmed_site_workers_answer_bitwise_and_a_restarted_one_reads_its_node_cache(prepared: dict, tmp_path: Path):
    """Five worker processes warmed up at start (``worker --warm-config --warm-run``): every reply says
    its process built or decoded nothing after the warm-up, and the run is the in-process engine's bit
    for bit (the unwarmed workers' run is too: tests/test_flower.py). C1's worker restarted on the
    same cache reads the encoder file and the decoded images: it builds no encoder and decodes nothing."""
    from fedhisto.federation.deploy import Procs, flower_env
    from fedhisto.federation.fastpath.launch_commands import worker_cmd
    from fedhisto.train.stage import run_train

    procs = Procs(tmp_path / "logs", flower_env(tmp_path / "home"))
    sock = {s: (tmp_path / "run" / s / "worker.sock").resolve() for s in SITES}
    cache = {s: (tmp_path / "cache" / s).resolve() for s in SITES}
    splits = {s: ("optimisation", "validation") if s == SITES[0] else ("optimisation",) for s in SITES}

    def start(site: str) -> Path:
        ready = tmp_path / f"ready_{site}.json"
        ready.unlink(missing_ok=True)
        procs.start(f"worker_{site}", worker_cmd(sock[site], site, prepared["manifest"], prepared["descriptors"],
                                                 cache_dir=cache[site], ready_file=ready,
                                                 warm_config=prepared["config"], warm_splits=splits[site],
                                                 warm_runs=(f"{RUN[0]}:{RUN[1]}",)))
        return ready

    def wait(ready: dict[str, Path]) -> dict[str, dict]:
        t0 = time.time()
        while not all(p.exists() for p in ready.values()):
            assert time.time() - t0 < 180, "workers not ready"
            assert all(procs.procs[f"worker_{s}"].poll() is None for s in ready), "a worker died"
            time.sleep(0.5)
        return {s: json.loads(p.read_text())["warmed"] for s, p in ready.items()}

    try:
        warmed = wait({s: start(s) for s in SITES})
        configs = node_configs(prepared, lambda s: {"worker": str(sock[s]), "cache-dir": str(cache[s])})
        infos = flower_run(prepared, tmp_path / "flower", configs)
        procs.stop("worker_C1")
        again = wait({"C1": start("C1")})["C1"]
    finally:
        assert procs.stop_all() == []
    for s, w in warmed.items():
        assert w["built"]["encoders_built"] == 1 and w["built"]["models_built"] == 1, (s, w)
        assert all(isinstance(w[k], float) for k in w if k != "built"), (s, w)  # no part failed
    by_pid = {}
    for info in infos:
        by_pid.setdefault(int(info["pid"]), []).append(info)
    assert len(by_pid) == 5 and sum(map(len, by_pid.values())) == len(infos)
    keys = ("encoders_built", "models_built", "images_decoded")
    for rows in by_pid.values():  # every message of every worker: nothing built or decoded after warm-up
        counts = {k: rows[0][k] for k in keys}
        assert counts in [w["built"] for w in warmed.values()] and all({k: r[k] for k in keys} == counts for r in rows)
    assert again["built"] == {"encoders_built": 0, "models_built": 1, "images_decoded": 0}, again
    assert len(list(cache["C1"].glob("encoder-tiny-*.pt"))) == 1

    run_train(RUN[0], RUN[1], prepared["manifest"], prepared["identity"], prepared["descriptors"],
              load_config_file(prepared["config"]), tmp_path / "inproc")
    assert_same_run(tmp_path / "inproc", tmp_path / "flower")


@needs_fastpath
def test_fedhisto_site_hands_its_warm_up_to_the_worker_and_refuses_runs_without_a_config(tmp_path: Path, monkeypatch):
    import fedhisto.cli as cli

    started = []

    class FakePopen:
        def __init__(self, cmd, env=None):
            started.append(cmd)

        def terminate(self):
            pass

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr("subprocess.Popen", FakePopen)
    monkeypatch.setattr(cli, "_exec", lambda cmd, env=None: 0)
    base = ["site", "--site", "C1", "--manifest", str(tmp_path / "m.csv"), "--insecure", "--fastpath",
            "--run-dir", str(tmp_path / "run"), "--flwr-home", str(tmp_path / "home")]
    (tmp_path / "config.yaml").write_text("{}\n")
    assert cli.main([*base, "--warm-config", str(tmp_path / "config.yaml"), "--warm-splits", "optimisation,validation",
                     "--warm-run", "past_v2:11", "--warm-run", "fedavg_peft:12"]) == 0
    worker = started[0]
    assert worker[worker.index("--warm-config") + 1] == str((tmp_path / "config.yaml").resolve())
    assert worker[worker.index("--warm-splits") + 1] == "optimisation,validation"
    assert [worker[i + 1] for i, a in enumerate(worker) if a == "--warm-run"] == ["past_v2:11", "fedavg_peft:12"]
    with pytest.raises(ValueError, match="site C1: warm runs"):
        cli.main([*base, "--warm-run", "past_v2:11"])
    from fedhisto.federation.fastpath.worker import parse_warm_run

    assert parse_warm_run("past_v2:11") == ("past_v2", 11)
    with pytest.raises(SystemExit, match="METHOD:SEED"):
        parse_warm_run("past_v2")
