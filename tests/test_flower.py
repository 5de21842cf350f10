"""Real federation on Flower (issue 13): records round-trip, the Flower engine equals the in-process
engine, a Flower checkpoint goes through predict/metrics/bootstrap, and a TLS + authenticated
deployment of a SuperLink and five SuperNodes on localhost survives a killed site and a SuperLink
restart. Skipped cleanly without flwr (``pip install -e ".[federation]"``)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from flower_support import SITES, LocalGrid, needs_fastpath, prepare

from fedhisto.config.study import load_config_file
from fedhisto.train.stage import run_train

pytestmark = pytest.mark.flower
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".svs", ".bmp")
# The Simulation Engine runs (Ray) are slow: past_v2 by default, these three with FEDHISTO_SIM_ALL=1.
SIM_METHODS = ("fedavg_peft", "past_v2", "fedstain")


def federable_methods() -> list[str]:
    """Every registered method with one global model that a federation can run (from the registry)."""
    from fedhisto.config.study import load_config
    from fedhisto.methods import build_method, method_names
    from fedhisto.methods.base import GLOBAL
    from fedhisto.methods.strategy import Strategy

    cfg = load_config({})
    out = []
    for name in method_names():
        m = build_method(name, cfg)
        if type(m).participants is Strategy.participants and m.members(["C1", "C2"]) == [GLOBAL]:
            out.append(name)
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict:
    p = prepare(tmp_path_factory.mktemp("flower"))
    p["dataset_identity"] = json.loads(p["identity"].read_text())["dataset_identity"]
    return p


_IN_PROCESS: dict[tuple[str, str], Path] = {}  # (config, method) -> the first in-process run's folder


def in_process(prepared: dict, method: str, out: Path) -> Path:
    """The in-process engine's run (the reference of the Flower paths), into ``out``. Several tests compare
    against the same run (past_v2 on the prepared config): it is trained once per module and copied, which
    is the same files, since a run is a function of its config, method and seed."""
    key = (str(prepared["config"]), method)
    if key not in _IN_PROCESS:
        run_train(method, 11, prepared["manifest"], prepared["identity"], prepared["descriptors"],
                  load_config_file(prepared["config"]), out)
        _IN_PROCESS[key] = out
    elif _IN_PROCESS[key] != out:
        shutil.copytree(_IN_PROCESS[key], out)
    return out / "checkpoint.pt"


def node_configs(prepared: dict) -> dict[int, dict]:
    return {100 + k: {"site-id": s, "manifest": str(prepared["manifest"]), "descriptors": str(prepared["descriptors"])}
            for k, s in enumerate(SITES)}


def local_flower(prepared: dict, method: str, out: Path, down_in_round: dict | None = None) -> Path:
    """The ServerApp's run over an in-process Grid (no Ray): the message path, fast."""
    from fedhisto.federation.server import FederatedRun
    from fedhisto.federation.server_app import GridExchange

    fed = FederatedRun(load_config_file(prepared["config"]), method, 11, SITES, out, prepared["dataset_identity"],
                       str(prepared["descriptors"]))
    grid = LocalGrid(node_configs(prepared), {})
    ex = GridExchange(grid, SITES, 60, 5, {"method": method, "seed": 11, "config": fed.cfg_json})
    ckpt = fed.run(ex)
    fed.finalise(ex, ckpt)
    return out / "checkpoint.pt"


def assert_same_states(a: Path, b: Path) -> None:
    ca, cb = (torch.load(p, map_location="cpu", weights_only=False) for p in (a, b))
    assert ca["round"] == cb["round"] == 2
    for key in ("members", "best"):
        sa = ca[key]["members"]["global"] if key == "best" else ca[key]["global"]
        sb = cb[key]["members"]["global"] if key == "best" else cb[key]["global"]
        assert sa.keys() == sb.keys()
        for name in sa:
            assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), f"{key}/{name} differs"
    assert_same_value(ca["server_state"], cb["server_state"], "server_state")
    assert [h["val_macro_f1"] for h in ca["history"]] == [h["val_macro_f1"] for h in cb["history"]]


def assert_same_value(a, b, where: str) -> None:
    """Bitwise equality of a server state of any shape: None, tensors, numbers, (nested) dicts and lists."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            assert_same_value(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_value(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def test_records_round_trip_every_hook_value_exactly():
    from flwr.app import RecordDict

    from fedhisto.federation.records import get_payload, get_value, put_payload, put_value
    from fedhisto.fedmath.fedstain_code_ops import PixelMoments
    from fedhisto.fedmath.fedstain_ops import StyleStats
    from fedhisto.fedmath.prototypes import ClientPrototypes, ServerPrototypes

    g = torch.Generator().manual_seed(0)
    values = {
        "state": {"lora_A": torch.randn(4, 8, generator=g), "head.bias": torch.randn(3, generator=g).double()},
        "server": ServerPrototypes(torch.randn(3, 8, generator=g), torch.rand(3, generator=g),
                                   torch.tensor([True, False, True]), torch.tensor([4.0, 0.0, 2.0])),
        "client": ClientPrototypes({0: torch.randn(8, generator=g), 2: torch.randn(8, generator=g)}, {0: 5, 2: 1}),
        "style": StyleStats(*(torch.randn(5, c, generator=g) for c in (3, 3, 8, 8))),
        "pixel": PixelMoments(torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)),
        "nested": {"c": {"w": torch.randn(2, 2, generator=g)}, "steps": 7, "lr": 0.5, "tag": "x", "pair": (1, None)},
        "none": None,
    }
    rd = RecordDict()
    for k, v in values.items():
        put_value(rd, k, v)
    back = {k: get_value(rd, k) for k in values}
    for name, t in values["state"].items():
        assert back["state"][name].dtype == t.dtype and torch.equal(back["state"][name], t)
    assert all(torch.equal(getattr(back["server"], f), getattr(values["server"], f))
               for f in ("centroids", "reliability", "mask", "counts"))
    assert back["server"].mask.dtype == torch.bool
    assert back["client"].counts == {0: 5, 2: 1} and torch.equal(back["client"].centroids[2], values["client"].centroids[2])
    assert torch.equal(back["style"].feat_kurt, values["style"].feat_kurt) and back["none"] is None
    assert isinstance(back["pixel"], PixelMoments) and torch.equal(back["pixel"].kurt, values["pixel"].kurt)
    assert back["nested"]["steps"] == 7 and back["nested"]["pair"] == (1, None) and back["nested"]["tag"] == "x"
    assert torch.equal(back["nested"]["c"]["w"], values["nested"]["c"]["w"])
    rd2 = RecordDict()
    put_payload(rd2, {"prototypes": values["server"], "style_pool": values["style"]})
    assert set(get_payload(rd2)) == {"prototypes", "style_pool"}


def test_records_refuse_what_they_cannot_carry_or_rebuild():
    from dataclasses import dataclass

    from flwr.app import ConfigRecord, RecordDict

    from fedhisto.federation.records import get_value, put_value

    with pytest.raises(TypeError, match=r"upload: no record encoding for set"):
        put_value(RecordDict(), "upload", {1, 2})

    @dataclass
    class Foreign:
        x: int

    Foreign.__module__ = "os"
    rd = RecordDict()
    put_value(rd, "upload", Foreign(1))
    with pytest.raises(ValueError, match=r"refusing to rebuild os:"):
        get_value(rd, "upload")
    rd["bad#meta"] = ConfigRecord({"json": '{"t": "weird"}'})
    with pytest.raises(ValueError, match="unknown record node kind 'weird'"):
        get_value(rd, "bad")


@pytest.mark.parametrize("method", federable_methods())
def test_flower_message_path_equals_in_process_engine_bitwise(prepared: dict, tmp_path: Path, method: str):
    """Same hooks, same client index k, same named RNG streams: the states are bitwise equal on CPU."""
    a = in_process(prepared, method, tmp_path / "inproc")
    b = local_flower(prepared, method, tmp_path / "flower")
    assert_same_states(a, b)
    assert (tmp_path / "inproc/validation_predictions.csv").read_text() == \
        (tmp_path / "flower/validation_predictions.csv").read_text()
    assert json.loads((tmp_path / "flower/status.json").read_text())["status"] == "finalised"


def test_a_pre_upload_variant_of_a_method_travels_the_message_path_bitwise(prepared: dict, tmp_path: Path):
    """SCAFFOLD's ``variates: start_gradient`` uploads gradients before training (the pre-upload hook of
    a non-default setting, which the registry-wide test above does not reach)."""
    import yaml

    doc = yaml.safe_load(Path(prepared["config"]).read_text())
    doc.setdefault("train", {})["scaffold"] = {"variates": "start_gradient"}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(doc))
    variant = {**prepared, "config": config}
    assert_same_states(in_process(variant, "scaffold", tmp_path / "inproc"),
                       local_flower(variant, "scaffold", tmp_path / "flower"))


@needs_fastpath
def test_site_workers_answer_every_message_bitwise_and_decode_once(prepared: dict, tmp_path: Path):
    """The fast path: each site's messages go to its long-lived worker (``fastpath.worker``), a
    separate process per site, whose replies are the in-process ones bit for bit; the ClientApp side
    forwards only; the decoded images land in the node-local cache (read back instead of decoding:
    tests/test_site_cache.py)."""
    from fedhisto.federation.deploy import Procs, flower_env
    from fedhisto.federation.fastpath.launch_commands import worker_cmd

    env = flower_env(tmp_path / "home")
    procs = Procs(tmp_path / "logs", env)
    sock = {s: tmp_path / "run" / s / "worker.sock" for s in SITES}
    cache = {s: tmp_path / "cache" / s for s in SITES}

    def start_workers() -> None:
        for s in SITES:
            ready = tmp_path / f"ready_{s}.json"
            procs.start(f"worker_{s}", worker_cmd(sock[s], s, prepared["manifest"], prepared["descriptors"],
                                                  cache_dir=cache[s], ready_file=ready))
        _wait_for(lambda: all((tmp_path / f"ready_{s}.json").exists() for s in SITES), HANG_S, "workers ready")

    def run(out: Path) -> list[dict]:
        from fedhisto.federation.server import FederatedRun
        from fedhisto.federation.server_app import GridExchange

        configs = {100 + k: {**nc, "worker": str(sock[nc["site-id"]].resolve()),
                             "cache-dir": str(cache[nc["site-id"]].resolve())}
                   for k, nc in enumerate(node_configs(prepared).values())}
        fed = FederatedRun(load_config_file(prepared["config"]), "past_v2", 11, SITES, out,
                           prepared["dataset_identity"], str(prepared["descriptors"]))
        ex = GridExchange(LocalGrid(configs, {}), SITES, 120, 5, {"method": "past_v2", "seed": 11,
                                                                   "config": fed.cfg_json})
        ckpt = fed.run(ex)
        fed.finalise(ex, ckpt)
        return [h["phases"] for h in ckpt["history"]]

    try:
        start_workers()
        phases = run(tmp_path / "flower")
        worker_pids = {p.pid for name, p in procs.procs.items() if name.startswith("worker_")}
        from fedhisto.federation.fastpath.worker import call

        # a worker serves its own node config only, and a garbled request leaves it serving
        _, refused = call(str(sock["C1"].resolve()), "query", b"", {"site-id": "C2"}, {})
        assert "serves site C1" in refused["refused"] and "site-id" in refused["refused"]
        mine = {**node_configs(prepared)[100], "worker": str(sock["C1"].resolve()),
                "cache-dir": str(cache["C1"].resolve())}
        _, garbled = call(str(sock["C1"].resolve()), "query", b"\xff\x00garbage", mine, {})
        assert "site C1 worker:" in garbled["refused"]
        assert procs.procs["worker_C1"].poll() is None
    finally:
        assert procs.stop_all() == []
    infos = [info for ph in phases for action in ph.values() for info in action["sites"].values()]
    assert infos and all(i["worker-served"] >= 1 and "worker-fallback" not in i for i in infos)
    for s in SITES:
        assert len(list(cache[s].glob("decoded-*.safetensors"))) == (2 if s == "C1" else 1)  # C1: also validation
    assert len(worker_pids) == 5 and {int(i["pid"]) for i in infos} == worker_pids  # answered by the workers
    a = in_process(prepared, "past_v2", tmp_path / "inproc")
    assert_same_states(a, tmp_path / "flower/checkpoint.pt")
    assert (tmp_path / "inproc/validation_predictions.csv").read_text() == \
        (tmp_path / "flower/validation_predictions.csv").read_text()


def test_federated_evaluation_equals_central_predict_and_metrics_and_counts_refuse_what_they_cannot_give(
        prepared: dict, tmp_path: Path):
    """Test set, holdouts and external cohort scored at the sites that hold them: the prediction files are
    the central predict stage's byte for byte, so metrics (and the bootstrap) are too; a site that opts
    out of rows returns counts, from which the count-computable metrics equal the per-image ones and
    AUROC, the ensemble and the bootstrap are refused naming it."""
    from fedhisto.federation.evaluate import CountsOnly, EvalTarget, cohort_metrics, require_rows
    from fedhisto.federation.server import FederatedRun
    from fedhisto.federation.server_app import GridExchange
    from fedhisto.metrics.stage import run_metrics
    from fedhisto.predict.stage import run_predict
    from fedhisto.stats.prediction_files import read_predictions
    from fedhisto.stats.scores import classification_metrics

    cfg = load_config_file(prepared["config"])
    train = tmp_path / "train"
    fed = FederatedRun(cfg, "past_v2", 11, SITES, train, prepared["dataset_identity"], str(prepared["descriptors"]))
    configs = node_configs(prepared)
    configs[200] = {"site-id": "TEST", "manifest": str(prepared["manifest"]), "descriptors": str(prepared["descriptors"])}
    configs[201] = {"site-id": "EXT", "manifest": str(prepared["manifest"]), "descriptors": str(prepared["descriptors"])}
    ex = GridExchange(LocalGrid(configs, {}), [*SITES, "TEST", "EXT"], 60, 5,
                      {"method": "past_v2", "seed": 11, "config": fed.cfg_json})
    ckpt = fed.run(ex)
    fed.finalise(ex, ckpt)
    targets = [EvalTarget(s, "holdout") for s in SITES] + [EvalTarget("TEST", "test"), EvalTarget("EXT", "external")]
    summary = fed.evaluate(ex, ckpt, targets, tmp_path / "fed")
    assert {c: v["basis"] for c, v in summary.items()} == {"test": "rows", "holdout": "rows", "external": "rows"}
    run_predict("past_v2", 11, train, prepared["manifest"], prepared["identity"], prepared["descriptors"], cfg,
                tmp_path / "central")
    for cohort in ("test", "holdout", "external"):
        assert (tmp_path / "fed" / f"{cohort}.csv").read_text() == (tmp_path / "central" / f"{cohort}.csv").read_text()
    for name in ("fed", "central"):
        run_metrics([("past_v2", 11, str(tmp_path / name), str(train))], cfg, tmp_path / f"metrics_{name}")
    for table in ("per_run.csv", "summary.csv", "client_level.csv", "ensembles.csv", "subgroups.csv"):
        assert (tmp_path / "metrics_fed" / table).read_text() == (tmp_path / "metrics_central" / table).read_text()

    configs[201]["report"] = "counts"  # the external site's own opt-out of per-image rows
    fed.evaluate(ex, ckpt, [EvalTarget("EXT", "external")], tmp_path / "counts")
    assert not (tmp_path / "counts/external.csv").exists()
    got = cohort_metrics(tmp_path / "counts", "external", cfg.evaluate.ece_bins)
    _, y, probs = read_predictions(tmp_path / "central/external.csv")["global"]
    want = classification_metrics(probs, y, cfg.evaluate.ece_bins)
    assert got["basis"] == "counts" and got["counts_from"] == ["EXT"] and got["n"] == want["n"] > 0
    assert got["confusion"] == want["confusion"] and got["per_class"] == want["per_class"]
    for k in ("accuracy", "balanced_accuracy", "macro_f1"):
        assert got[k] == want[k], k  # from the same confusion matrix: exact
    for k in ("nll", "brier", "ece"):  # sums in another order; the rows were written with 8 decimals
        assert abs(got[k] - want[k]) < 1e-6, (k, got[k], want[k])
    assert got["macro_auroc"] is None and set(got["not_computable"]) == {"macro_auroc", "macro_auprc"}
    with pytest.raises(CountsOnly, match=r"bootstrap of external needs per-image rows; site\(s\) EXT returned"):
        require_rows(tmp_path / "counts", "external", "the paired bootstrap")
    assert require_rows(tmp_path / "fed", "external", "the paired bootstrap") == tmp_path / "fed/external.csv"


def test_a_site_that_does_not_answer_is_recorded_unavailable(prepared: dict, tmp_path: Path):
    from fedhisto.federation.server import FederatedRun
    from fedhisto.federation.server_app import GridExchange

    fed = FederatedRun(load_config_file(prepared["config"]), "fedavg_peft", 11, SITES, tmp_path,
                       prepared["dataset_identity"], str(prepared["descriptors"]))
    grid = LocalGrid(node_configs(prepared), {})
    grid.down = {104}  # C5 never replies
    ex = GridExchange(grid, SITES, 60, 5, {"method": "fedavg_peft", "seed": 11, "config": fed.cfg_json})
    ckpt = fed.run(ex)
    assert all(set(h["unavailable_clients"]) == {"C5"} for h in ckpt["history"])
    assert all("C5" not in h["weights"] for h in ckpt["history"])


def test_a_site_on_other_code_is_refused_by_name_and_the_others_train(prepared: dict, tmp_path: Path, monkeypatch):
    import fedhisto.federation.handlers as handlers
    from fedhisto.federation.server import FederatedRun
    from fedhisto.federation.server_app import GridExchange
    from fedhisto.infra.code_identity import identity_strings

    real = identity_strings()

    def code_of_this_site():  # the ClientApp's site: C3 runs another build of the package
        import inspect

        site = next(f.frame.f_locals["site"] for f in inspect.stack() if "site" in f.frame.f_locals)
        return {**real, "source_digest": "0" * 64} if site.sc.site == "C3" else real

    monkeypatch.setattr(handlers, "identity_strings", code_of_this_site)
    fed = FederatedRun(load_config_file(prepared["config"]), "fedavg_peft", 11, SITES, tmp_path,
                       prepared["dataset_identity"], str(prepared["descriptors"]))
    ex = GridExchange(LocalGrid(node_configs(prepared), {}), SITES, 60, 5,
                      {"method": "fedavg_peft", "seed": 11, "config": fed.cfg_json})
    ckpt = fed.run(ex)
    for h in ckpt["history"]:
        assert set(h["unavailable_clients"]) == {"C3"} and "C3" not in h["weights"] and len(h["weights"]) == 4
        assert "refused: site C3 runs other code: source digest 0000" in h["unavailable_clients"]["C3"]


def test_flower_checkpoint_goes_through_predict_metrics_and_bootstrap(prepared: dict, tmp_path: Path):
    from fedhisto.bootstrap.stage import run_bootstrap
    from fedhisto.metrics.stage import run_metrics
    from fedhisto.predict.stage import run_predict

    cfg = load_config_file(prepared["config"])
    train = tmp_path / "results/train/fedavg_peft/seed11"
    local_flower(prepared, "fedavg_peft", train)
    preds = tmp_path / "results/predictions/fedavg_peft/seed11"
    run_predict("fedavg_peft", 11, train, prepared["manifest"], prepared["identity"], prepared["descriptors"], cfg,
                preds)
    assert all((preds / f"{c}.csv").exists() for c in ("test", "holdout", "external"))
    summary = run_metrics([("fedavg_peft", 11, str(preds))], cfg, tmp_path / "results/metrics")
    assert summary
    ext = str(preds / "external.csv")
    comparisons = {"self": {"method": "fedavg_peft", "reference": "fedavg_peft", "ablation": False}}
    bcfg = cfg.bootstrap.model_copy(update={"resamples": 50, "comparisons": {
        "self": type(next(iter(cfg.bootstrap.comparisons.values())))(**comparisons["self"])}})
    res = run_bootstrap("self", [ext], [ext], ([11], [11]), bcfg, tmp_path / "results/bootstrap/self.json")
    assert res


# --------------------------------------------------------------------------- Flower's own runtimes
# Deadlines of the deployment tests are hang guards, not speed checks: a fresh-clone CI on a slow day,
# beside three other lanes, did not see the deployment's first round within 150 s.
HANG_S = 600.0


def _wait_for(pred, timeout: float, what: str, poll: float = 0.5):
    t0 = time.time()
    while time.time() - t0 < timeout:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def _events(log_dir: Path) -> list[dict]:
    p = log_dir / "events.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def run_config(prepared: dict, method: str, out: Path, log_dir: Path, **extra) -> dict:
    return {"method": method, "seed": 11, "config": str(prepared["config"]), "descriptors": str(prepared["descriptors"]),
            "out-dir": str(out), "dataset-identity": prepared["dataset_identity"], "log-dir": str(log_dir),
            "round-timeout": 240.0, **extra}


@pytest.mark.parametrize("method", [m for m in SIM_METHODS if os.environ.get("FEDHISTO_SIM_ALL") or m == "past_v2"])
def test_simulation_engine_equals_in_process_engine(prepared: dict, tmp_path: Path, method: str):
    """``flwr run`` on Flower's Simulation Engine (Ray). Ray's start dominates (~2 min on 2 cores), so CI
    runs past_v2 only; FEDHISTO_SIM_ALL=1 runs all three methods."""
    pytest.importorskip("ray")
    from fedhisto.federation import APP_DIR
    from fedhisto.federation.deploy import (
        Procs,
        flower_env,
        flwr_cli,
        free_port,
        run_config_arg,
        write_connection,
    )

    home = tmp_path / "flwr_home"
    write_connection(home, "sim", ":local-in-memory:", simulation={"num_supernodes": 5, "num_cpus": 2})
    env = flower_env(home, extra={"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
                                  "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())})
    procs = Procs(tmp_path / "logs", env)
    rc = run_config(prepared, method, tmp_path / "flower", tmp_path / "serverapp",
                    **{"sim-manifest": str(prepared["manifest"]), "sim-descriptors": str(prepared["descriptors"])})
    try:
        flwr_cli(["run", str(APP_DIR), "sim", "--run-config", run_config_arg(rc), "--stream"], env, timeout=600,
                 cwd=tmp_path)
        _wait_for(lambda: (tmp_path / "flower/status.json").exists(), HANG_S, "status.json")
    finally:
        assert procs.stop_all() == []
    assert_same_states(in_process(prepared, method, tmp_path / "inproc"), tmp_path / "flower/checkpoint.pt")


def test_deployment_tls_auth_killed_site_and_superlink_restart(prepared: dict, tmp_path: Path):
    """A SuperLink and five SuperNodes on localhost, TLS and SuperNode authentication on; past_v2, two rounds;
    every process Flower's own, as ``fedhisto site`` starts it (a new ClientApp process per message that
    imports torch and reads the site's decoded images). The SuperLink is restarted between rounds (the
    ServerApp dies with it; a new run resumes from the checkpoint); C5's SuperNode is killed during
    round 2 (inside its ClientApp's start-up) and recorded unavailable, once the SuperLink has missed two
    of its 30 s heartbeats; C5 rejoins under its registered name; the ServerApp opens no image; every
    process is stopped on exit. The fast path's deployment: the site-local deployment test below."""
    from fedhisto.federation import APP_DIR
    from fedhisto.federation.deploy import (
        Procs,
        flower_env,
        flwr_cli,
        free_port,
        json_out,
        make_site_key,
        make_tls,
        run_config_arg,
        superlink_cmd,
        supernode_cmd,
        wait_port,
        write_connection,
    )

    t_start = time.time()
    wd = tmp_path
    tls = make_tls(wd / "certs")
    keys = {s: make_site_key(wd / "keys", s) for s in SITES}
    port = free_port()
    home = wd / "flwr_home"
    write_connection(home, "lab", f"127.0.0.1:{port}", root_certificates=tls["ca"])
    env = flower_env(home)
    procs = Procs(wd / "logs", env)
    out, logs = wd / "results/train/past_v2/seed11", wd / "serverapp"
    sl = superlink_cmd(port, tls=tls, database=wd / "superlink.db")
    rc = run_config(prepared, "past_v2", out, logs, **{"pause-between-rounds": 15.0})
    timings = {}
    try:
        procs.start("superlink", sl)
        wait_port(port)
        node_ids = {s: json_out(flwr_cli(["supernode", "register", str(keys[s][1]), "lab", "--name", s, "--format",
                                          "json"], env))["node-id"] for s in SITES}

        def start_node(s: str) -> None:
            procs.start(f"supernode_{s}", supernode_cmd(f"127.0.0.1:{port}", s, prepared["manifest"],
                                                        prepared["descriptors"], tls["ca"], keys[s][0],
                                                        runtime_port=free_port(), cache_dir=wd / "cache" / s))

        for s in SITES:
            start_node(s)
        flwr_cli(["run", str(APP_DIR), "lab", "--run-config", run_config_arg(rc), "--format", "json"], env, cwd=wd)
        _wait_for(lambda: any(e["event"] == "checkpoint" and e["round"] == 1 for e in _events(logs)), HANG_S, "round 1")
        timings["round1_done_s"] = time.time() - t_start
        # SuperLink down between rounds (during the ServerApp's pause): the ServerApp process goes with it
        procs.stop("superlink")
        procs.start("superlink", sl)
        wait_port(port)
        flwr_cli(["run", str(APP_DIR), "lab", "--run-config", run_config_arg(rc), "--format", "json"], env, cwd=wd)
        _wait_for(lambda: [e for e in _events(logs) if e["event"] == "send" and e["action"] == "train"
                           and e["round"] == 2], HANG_S, "round 2 sent")
        time.sleep(1.0)  # C5 is now inside round 2: its ClientApp process is still importing torch
        procs.stop("supernode_C5", sig=signal.SIGKILL)
        timings["killed_c5_s"] = time.time() - t_start
        _wait_for(lambda: any(e["event"] in ("finished", "failed") for e in _events(logs)), HANG_S, "run end", poll=1.0)
        timings["finished_s"] = time.time() - t_start
        start_node("C5")  # rejoins with its key: the SuperLink keeps its registration and node id
        nodes = json_out(flwr_cli(["supernode", "list", "lab", "--format", "json"], env))["nodes"]
        assert {str(n["node-id"]) for n in nodes} == {str(v) for v in node_ids.values()}
    finally:
        leftover = procs.stop_all()
        (wd / "timings.json").write_text(json.dumps(timings))
        print("timings", timings)
    assert leftover == []
    events = _events(logs)
    assert not [e for e in events if e["event"] == "failed"], events
    ckpt = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert ckpt["round"] == 2 and ckpt["resumed_at_rounds"] == [1]
    assert ckpt["history"][0]["unavailable_clients"] == {}
    assert set(ckpt["history"][1]["unavailable_clients"]) == {"C5"}
    assert "C5" not in ckpt["history"][1]["weights"] and len(ckpt["history"][1]["weights"]) == 4
    assert json.loads((out / "status.json").read_text())["status"] == "finalised"
    served = {}  # round 1, every action: each site's reply came from Flower's own ClientApp process
    for action in ckpt["history"][0]["phases"].values():
        for site, info in action["sites"].items():
            served.setdefault(site, set()).add(info.get("worker-task") == 1)
    assert served == {s: {False} for s in SITES}, served
    audits = [json.loads(p.read_text()) for p in logs.glob("serverapp_open_audit.*.json")]
    assert len(audits) >= 2  # the first and the resumed ServerApp
    data_root = str(prepared["images"])
    for a in audits:
        assert "flwr-serverapp" in " ".join(a["argv"])
        bad = [p for p in a["opened"] if p.lower().endswith(IMAGE_EXTS) or p.startswith(data_root)]
        assert bad == [], bad
    shutil.rmtree(wd / "flwr_home", ignore_errors=True)
    subprocess.run(["true"])


@needs_fastpath
def test_deployment_sites_with_only_their_own_folders_prepare_train_evaluate_at_the_coordinator(tmp_path: Path):
    """Issue 24's deployment: eight sites (C1..C5 train; VAL, TEST, EXT hold validation, test and the
    external cohort), each prepared from and started with only its own image folder; the coordinator
    checks the uploads, trains past_v2 over TLS + SuperNode authentication (the fast path: site workers),
    has the evaluation done at the sites and computes metrics and the bootstrap from what returns.
    Reference: the in-process pipeline (train, predict, metrics, bootstrap) on the union of the site
    manifests, i.e. the same images in the same splits: states, prediction files, every metrics
    table and the bootstrap are equal. Each site worker opened no image but its own, the ServerApp none."""
    import yaml
    from flower_support import ROLES, SITE_FOLDERS, SITE_LOCAL, render_site_folders

    from fedhisto.bootstrap.stage import run_bootstrap
    from fedhisto.config.study import load_config
    from fedhisto.federation.coordinator import check_uploads
    from fedhisto.federation.fastpath.worker import AUDIT_VAR
    from fedhisto.federation.localhost import LocalFederation, SiteSpec, wait_run_end
    from fedhisto.federation.prepare import prepare_site
    from fedhisto.metrics.stage import run_metrics
    from fedhisto.predict.stage import run_predict

    cfg = load_config(SITE_LOCAL)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(SITE_LOCAL))
    folders = render_site_folders(tmp_path / "data")
    prepared = {s: tmp_path / "sites" / s for s in SITE_FOLDERS}
    for s, folder in folders.items():
        prepare_site(folder, s, prepared[s], cfg, role=ROLES.get(s, "client"))
    coord = tmp_path / "coordinator"
    check = check_uploads([prepared[s] / "upload.json" for s in SITE_FOLDERS], cfg, coord)
    clients = [s for s in SITE_FOLDERS if s not in ROLES]
    manifests = {s: prepared[s] / "manifest/manifest.csv" for s in SITE_FOLDERS}
    descriptors = coord / "descriptors.json"

    audits = tmp_path / "audits"
    audits.mkdir()
    fed = LocalFederation(tmp_path / "fed", [SiteSpec(s, manifests[s], descriptors) for s in SITE_FOLDERS],
                          fastpath=True)
    fed.env[AUDIT_VAR] = str(audits)
    out, preds, logs = coord / "train/past_v2/seed11", coord / "predictions/past_v2/seed11", coord / "serverapp"
    evaluate = ",".join([f"{c}:holdout" for c in clients] + ["TEST:test", "EXT:external"])
    try:
        fed.start()
        fed.run({"method": "past_v2", "seed": 11, "config": str(config), "descriptors": str(descriptors),
                 "out-dir": str(out), "dataset-identity": check["dataset_identity"], "log-dir": str(logs),
                 "sites": ",".join(clients), "eval-site": "VAL", "evaluate": evaluate,
                 "predictions-dir": str(preds), "round-timeout": 300.0})
        end = wait_run_end(logs, 600)
    finally:
        leftover = fed.stop()
    assert leftover == []
    assert end["event"] == "finished", _events(logs)[-3:]
    run_metrics([("past_v2", 11, str(preds), str(out))], cfg, coord / "metrics")
    comparisons = {"self": {"method": "past_v2", "reference": "past_v2", "ablation": False}}
    bcfg = cfg.bootstrap.model_copy(update={"resamples": 200, "comparisons": {
        "self": type(next(iter(cfg.bootstrap.comparisons.values())))(**comparisons["self"])}})
    ext = str(preds / "external.csv")
    fed_boot = run_bootstrap("self", [ext], [ext], ([11], [11]), bcfg, coord / "bootstrap/self.json")

    # the central pipeline on the same images and splits: the union of the site manifests
    central = tmp_path / "central"
    central.mkdir()
    rows = [r for s in SITE_FOLDERS for r in csv.DictReader(manifests[s].read_text().splitlines())]
    with (central / "manifest.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (central / "manifest.json").write_text(json.dumps({"dataset_identity": check["dataset_identity"]}))
    run_train("past_v2", 11, central / "manifest.csv", central / "manifest.json", descriptors, cfg, central / "train")
    run_predict("past_v2", 11, central / "train", central / "manifest.csv", central / "manifest.json", descriptors,
                cfg, central / "predictions")
    run_metrics([("past_v2", 11, str(central / "predictions"), str(central / "train"))], cfg, central / "metrics")
    cext = str(central / "predictions/external.csv")
    central_boot = run_bootstrap("self", [cext], [cext], ([11], [11]), bcfg, central / "bootstrap.json")

    assert_same_states(central / "train/checkpoint.pt", out / "checkpoint.pt")
    history = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["history"]
    tasks = {(site, info.get("worker-task")) for h in history for ph in h["phases"].values()
             for site, info in ph["sites"].items()}
    assert tasks == {(s, 1) for s in [*clients, "VAL"]}, tasks  # each task run by the site's worker (launcher)
    assert (central / "train/validation_predictions.csv").read_text() == (out / "validation_predictions.csv").read_text()
    for cohort in ("test", "holdout", "external"):
        assert (central / f"predictions/{cohort}.csv").read_text() == (preds / f"{cohort}.csv").read_text(), cohort
    for table in ("per_run.csv", "summary.csv", "client_level.csv", "ensembles.csv", "subgroups.csv"):
        assert (central / f"metrics/{table}").read_text() == (coord / f"metrics/{table}").read_text(), table
    strip = lambda d: {k: v for k, v in d.items() if k != "provenance"}  # noqa: E731
    assert json.loads(json.dumps(strip(fed_boot), default=str)) == json.loads(json.dumps(strip(central_boot),
                                                                                          default=str))
    ev = json.loads((preds / "evaluation.json").read_text())["cohorts"]
    assert ev["holdout"] == {"basis": "rows", "sites": dict.fromkeys(clients, "rows")}
    assert ev["external"]["sites"] == {"EXT": "rows"} and ev["test"]["sites"] == {"TEST": "rows"}

    # file-open audits: a site's worker read images of its own folder only; the ServerApp read none
    data = os.path.realpath(tmp_path / "data")
    for s in SITE_FOLDERS:
        opened = json.loads((audits / f"worker_open_audit.{s}.json").read_text())["opened"]
        images = {p for p in opened if p.startswith(data)}
        assert images and all(p.startswith(os.path.realpath(folders[s])) for p in images), (s, sorted(images)[:3])
        others = [p for p in opened if any(p.startswith(os.path.realpath(prepared[o])) for o in SITE_FOLDERS if o != s)]
        assert others == [], (s, others[:3])
    for a in (json.loads(p.read_text()) for p in logs.glob("serverapp_open_audit.*.json")):
        assert [p for p in a["opened"] if p.lower().endswith(IMAGE_EXTS) or p.startswith(data)] == []


def test_a_site_whose_image_fails_to_decode_and_a_site_on_other_descriptors_are_refused_by_name(
        prepared: dict, tmp_path: Path):
    """Bad input at training time: C3's manifest lists an image that cannot be decoded (truncated), C2
    was handed descriptors that are not the run's. Each round names both with the reason (C3's sample
    id, never its path), aggregates the other three, and the run finalises."""
    from fedhisto.federation.server import FederatedRun
    from fedhisto.federation.server_app import GridExchange

    rows = list(csv.DictReader(Path(prepared["manifest"]).read_text().splitlines()))
    victim = next(r for r in rows if r["client"] == "C3" and r["split"] == "optimisation")
    broken = tmp_path / "broken.jpeg"
    data = Path(victim["path"]).read_bytes()
    broken.write_bytes(data[: len(data) // 2])
    victim["path"] = str(broken)
    manifest = tmp_path / "manifest_C3.csv"
    with manifest.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    doc = json.loads(Path(prepared["descriptors"]).read_text())
    doc["clients"]["C2"]["standardised"][0] += 0.5
    other = tmp_path / "descriptors_C2.json"
    other.write_text(json.dumps(doc))
    configs = node_configs(prepared)
    configs[102]["manifest"], configs[101]["descriptors"] = str(manifest), str(other)
    fed = FederatedRun(load_config_file(prepared["config"]), "past_v2", 11, SITES, tmp_path / "run",
                       prepared["dataset_identity"], str(prepared["descriptors"]))
    ex = GridExchange(LocalGrid(configs, {}), SITES, 60, 5, {"method": "past_v2", "seed": 11, "config": fed.cfg_json})
    ckpt = fed.run(ex)
    fed.finalise(ex, ckpt)
    for h in ckpt["history"]:
        assert set(h["unavailable_clients"]) == {"C2", "C3"} and sorted(h["weights"]) == ["C1", "C4", "C5"]
        assert h["unavailable_clients"]["C2"] == "refused: site C2: its stain descriptor differs from the run's descriptors"
        why = h["unavailable_clients"]["C3"]
        assert f"site C3: image {victim['sample_id']} cannot be decoded" in why and str(broken) not in why
    assert json.loads((tmp_path / "run/status.json").read_text())["status"] == "finalised"


def test_fedhisto_site_starts_stock_flower_and_with_fastpath_the_worker_and_a_supernode_that_hands_it_tasks(
        tmp_path: Path, monkeypatch, capsys):
    """``fedhisto site``: Flower's own ``flower-supernode`` alone by default (its node config names the
    node cache and the site's report choice). ``--fastpath``: the worker gets the node config the
    SuperNode gets, ends with the command, and the SuperNode goes through ``supernode_poll`` with
    ``--site-worker``; on a Flower the fast path is not tested against, it is refused before any start."""
    import fedhisto.cli as cli
    from fedhisto.federation.fastpath import supported

    started, ran = [], []

    class FakePopen:
        def __init__(self, cmd, env=None):
            started.append(cmd)

        def terminate(self):
            started.append("terminated")

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr("subprocess.Popen", FakePopen)
    monkeypatch.setattr(cli, "_exec", lambda cmd, env=None: ran.append(cmd) or 0)
    base = ["site", "--site", "C3", "--manifest", str(tmp_path / "m.csv"), "--insecure",
            "--run-dir", str(tmp_path / "run"), "--flwr-home", str(tmp_path / "home"), "--report", "counts"]
    assert cli.main(base) == 0
    assert started == [] and Path(ran[0][0]).name == "flower-supernode" and "worker" not in " ".join(ran[0])
    nc = ran[0][ran[0].index("--node-config") + 1]
    assert f"cache-dir='{(tmp_path / 'run/cache').resolve()}'" in nc and "report='counts'" in nc
    with pytest.raises(ValueError, match="--fastpath only"):
        cli.main([*base, "--warm-config", str(tmp_path / "config.yaml")])
    ran.clear()
    if not supported():
        capsys.readouterr()
        assert cli.main([*base, "--fastpath"]) == 2
        assert "fast path (fedhisto.federation.fastpath) modifies Flower's process model and is tested against " \
               "flwr 1.42.x only" in capsys.readouterr().err
        assert started == [] and ran == []
        return
    assert cli.main([*base, "--fastpath"]) == 0
    worker, supernode = started[0], ran[0]
    assert worker[1:3] == ["-m", "fedhisto.federation.fastpath.worker"] and started[1] == "terminated"
    socket_path = worker[worker.index("--socket") + 1]
    assert socket_path == str((tmp_path / "run/worker.sock").resolve())
    node_config = json.loads(worker[worker.index("--node-config") + 1])
    assert node_config["report"] == "counts" and node_config["cache-dir"] == str((tmp_path / "run/cache").resolve())
    assert supernode[1:5] == ["-m", "fedhisto.federation.fastpath.supernode_poll", "--site-worker", socket_path]
    assert supernode[supernode.index("--node-config") + 1] == nc  # the stock SuperNode's arguments, unchanged


def test_a_batched_config_federates_as_the_sequential_engine_with_its_identity(prepared: dict, tmp_path: Path):
    """Every site trains alone, so the Flower engine is the sequential engine whatever ``train.engine``
    says; the run identity (and the config the sites get) says sequential, as an old run's does."""
    from fedhisto.federation.server import FederatedRun

    cfg = load_config_file(prepared["config"])
    batched = cfg.model_copy(update={"train": cfg.train.model_copy(update={"engine": "batched"})})
    a = FederatedRun(batched, "fedavg_peft", 11, SITES, tmp_path / "a", prepared["dataset_identity"],
                     str(prepared["descriptors"]))
    b = FederatedRun(cfg, "fedavg_peft", 11, SITES, tmp_path / "b", prepared["dataset_identity"],
                     str(prepared["descriptors"]))
    assert a.cfg.train.engine == "sequential" and json.loads(a.cfg_json)["train"]["engine"] == "sequential"
    assert a.identity == b.identity
