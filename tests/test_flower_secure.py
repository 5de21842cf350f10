"""Secure aggregation on Flower's own SecAgg+ (issue 47): the quantiser is Flower's; the ServerApp's secure
round over the ClientApp (an in-process Grid) equals the study's equations on the sites' own states within
the stated bound, for FedAvg-PEFT, PAST v2 and FedEx-LoRA, and no server hook ever sees one site's record;
a site lost inside a masked sum is unmasked by SecAgg+ and the sum is the survivors'; one lost before its
key shares went out restarts the masked sum (Flower 1.42 alone fails there); the fast path refuses; and a
deployment of stock processes (SuperLink, five SuperNodes, TLS, SuperNode authentication) runs the three
methods with a SuperNode killed mid-round. Skipped without flwr."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flower_support import SITES, LocalGrid, prepare
from test_secure_aggregation import _assert_pairs_match, _reference, eq4, secure_cfg

pytestmark = pytest.mark.flower
#: the record names a site's reply may hold in the clear under secure aggregation (events.jsonl, "clear")
CLEAR = {"code", "descriptor", "descriptor#meta", "identity", "info", "metrics", "secure", "statistics",
         "validation-counts", "samples", "probs:global", "probs:global#meta"}
SECRET = {"state", "upload", "upload#meta", "losses"}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict:
    p = prepare(tmp_path_factory.mktemp("flower_secure"))
    p["dataset_identity"] = json.loads(p["identity"].read_text())["dataset_identity"]
    return p


_PLAIN: dict[str, dict] = {}  # method -> the sites' states of an in-process round 1 without secure aggregation


def sites_round(prepared: dict, method: str, root: Path) -> dict:
    """The sites' trained states and counts of round 1 (the in-process engine, which the Flower message
    path equals bit for bit: tests/test_flower.py), recorded where its aggregation receives them."""
    if method not in _PLAIN:
        from conftest import train

        from fedhisto.methods import registration

        cls = registration(method).method_class()
        original, seen = cls.aggregate_train, []

        def spy(self, update, model):
            seen.append({"states": update.states, "starts": update.starts, "counts": dict(update.counts)})
            return original(self, update, model)

        cls.aggregate_train = spy
        try:
            train(prepared, method, root / f"plain_{method}", secure_cfg(prepared, (method,), secure=False))
        finally:
            cls.aggregate_train = original
        _PLAIN[method] = seen[0]
    return _PLAIN[method]


def sample_mass(counts: dict, sites) -> dict:
    total = sum(counts[n] for n in sites)
    return {n: counts[n] / total for n in sites}


def local_secure_run(prepared: dict, method: str, out: Path, on_message=None, spies: dict | None = None) -> dict:
    """The ServerApp's secure run over an in-process Grid that calls the ClientApp (each node keeps its
    Context.state, as a SuperNode does); ``on_message(grid, message)`` may take a node down."""
    from fedhisto.federation.server import FederatedRun
    from fedhisto.federation.server_app import GridExchange

    cfg = secure_cfg(prepared, (method,))
    fed = FederatedRun(cfg, method, 11, SITES, out, prepared["dataset_identity"], str(prepared["descriptors"]),
                       events=out / "events.jsonl")
    fed.secure_timeout = 5.0
    for name, fn in (spies or {}).items():
        setattr(fed.method, name, fn(getattr(fed.method, name)))
    nodes = {100 + k: {"site-id": s, "manifest": str(prepared["manifest"]), "descriptors": str(prepared["descriptors"])}
             for k, s in enumerate(SITES)}
    grid = LocalGrid(nodes, {})
    if on_message is not None:
        grid.on_message = lambda m: on_message(grid, m)
    ex = GridExchange(grid, SITES, 60, 5, {"method": method, "seed": 11, "config": fed.cfg_json})
    out.mkdir(parents=True, exist_ok=True)
    ckpt = fed.run(ex)
    fed.finalise(ex, ckpt)
    return ckpt


def events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def assert_clear_audit(evs: list[dict]) -> None:
    """Every reply the coordinator received held only public records, never a state, upload or loss."""
    seen = [e for e in evs if e["event"] == "clear"]
    assert seen
    for e in seen:
        for site, names in e["records"].items():
            assert not set(names) & SECRET and set(names) <= CLEAR, (e["action"], site, names)


def test_our_quantiser_is_flowers():
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    from fedhisto.fedmath.secure_sums import Quantiser

    q = Quantiser(clip=8.0, levels=2 ** 28)
    x = np.random.default_rng(0).uniform(-9, 9, size=(64, 33))  # some values beyond the clip
    np.random.seed(5)
    theirs = quantize([x], 8.0, 2 ** 28)[0]
    np.random.seed(5)
    ours = q.quantise(x, np.random.rand(*x.shape))
    assert np.array_equal(ours, theirs)
    np.testing.assert_allclose(q.sum_value(ours, 1), dequantize([theirs], 8.0, 2 ** 28)[0], atol=1e-12)


def forbidden(name: str):
    def wrap(_original):
        def refuse(*args, **kwargs):
            raise AssertionError(f"{name} called under secure aggregation")
        return refuse
    return wrap


def recording(calls: list, name: str):
    def wrap(original):
        def record(*args, **kwargs):
            calls.append((name, args))
            return original(*args, **kwargs)
        return record
    return wrap


@pytest.mark.parametrize("method", ["fedavg_peft", "past_v2", "fedex_lora"])
def test_the_secure_flower_round_is_the_equations_on_the_sites_states_and_no_hook_sees_a_site(
        prepared: dict, tmp_path: Path, method: str):
    from fedhisto.fedmath.lora_aggregators.fold import folded_key
    from fedhisto.methods.secure_capability import SecureSums, SiteStatistics

    plain = sites_round(prepared, method, tmp_path)
    calls: list = []
    spies = {h: forbidden(h) for h in ("aggregate_train", "client_weights", "aggregate_uploads")}
    spies.update({h: recording(calls, h) for h in ("aggregate_sums", "secure_weights", "aggregate_post_sums")})
    ckpt = local_secure_run(prepared, method, tmp_path / "flower", spies=spies)
    row = ckpt["history"][0]
    states, counts = plain["states"], plain["counts"]
    for name, args in calls:  # the server step's inputs: sums over every site, or public scalars
        assert isinstance(args[0], SecureSums | SiteStatistics), name
        if isinstance(args[0], SecureSums):
            assert len(args[0].weights) == 5, name
    if method == "past_v2":
        names = sorted(states)
        d = np.stack([torch.cat([(states[n][k].double() - plain["starts"][n][k].double()).flatten()
                                 for k in sorted(plain["starts"][n])]).numpy() for n in names])
        want = dict(zip(names, eq4([counts[n] for n in names], d), strict=True))
        assert row["weights"] == pytest.approx(want, abs=1e-7)
        assert [n for n, _ in calls] == ["secure_weights", "aggregate_sums", "aggregate_post_sums"]
        assert ckpt["server_state"]["mask"].all()
    else:
        assert row["weights"] == pytest.approx(sample_mass(counts, SITES), abs=1e-15)
    bound = row["secure_aggregation"]["terms"]["bound"]
    assert bound == pytest.approx(5 * 16 / 2 ** 28)
    ref, got = _reference(states, row["weights"]), ckpt["members"]["global"]
    if method == "fedex_lora":  # the folded offset + s B' A' is the sites' weighted model
        for key, want in ref.items():
            have = (got[folded_key(key)].double() + 2.0 * got[key.replace("lora_A", "lora_B")].double() @ got[key].double()
                    if ".lora_A." in key else got[key].double())
            assert float((have - want).abs().max()) <= 4 * bound + 2e-7 * float(want.abs().max()), key
    else:
        _assert_pairs_match(got, ref, bound)
    assert_clear_audit(events(tmp_path / "flower/events.jsonl"))


def _down_at(stage: str, key: str, node: int = 104):
    def on(grid, m):
        cr = m.content.config_records
        if "secaggplus_configs" in cr and cr["secaggplus_configs"].get("stage") == stage \
                and m.metadata.dst_node_id == node:
            if "fitins.config" in cr and str(cr["fitins.config"]["fedhisto-key"]) != key:
                return
            grid.down.add(node)
    return on


@pytest.mark.parametrize("stage", ["collect_masked_vectors", "share_keys"])
def test_a_site_lost_in_a_masked_sum_leaves_the_survivors_sum(prepared: dict, tmp_path: Path, stage: str):
    """Lost while its masked vector is collected: SecAgg+ rebuilds its masks from the others' shares. Lost
    before its shares went out: the masked sum restarts without it. Either way the aggregate is the
    equations over the four survivors, with their sample-mass weights."""
    plain = sites_round(prepared, "fedavg_peft", tmp_path)
    ckpt = local_secure_run(prepared, "fedavg_peft", tmp_path / "flower", on_message=_down_at(stage, "terms"))
    row = ckpt["history"][0]
    survivors = ["C1", "C2", "C3", "C4"]
    assert row["secure_aggregation"]["terms"]["sites"] == survivors and list(row["unavailable_clients"]) == ["C5"]
    assert stage in row["unavailable_clients"]["C5"]
    weights = sample_mass(plain["counts"], survivors)
    assert row["weights"] == pytest.approx(weights, abs=1e-15)
    states = {n: plain["states"][n] for n in survivors}
    _assert_pairs_match(ckpt["members"]["global"], _reference(states, weights),
                        row["secure_aggregation"]["terms"]["bound"])


def test_flower_alone_fails_when_a_site_is_lost_before_its_shares_went_out():
    """Why the restart: Flower 1.42's stages, run as its workflow runs them, ask the survivors for shares of
    the lost site's key that they never received (its client mod indexes them by the dead node)."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.common import FitIns, Parameters
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

    from fedhisto.federation.secagg import _Instructions
    from fedhisto.federation.secure_site import keep

    grid = LocalGrid({100 + k: {"site-id": s} for k, s in enumerate(SITES)}, {})
    for k in range(5):
        grid.states[100 + k] = RecordDict()
        keep(grid.states[100 + k], "terms", 0, {"x": torch.full((3,), float(k + 1))})
    grid.on_message = lambda m: _down_at("share_keys", "terms")(grid, m)
    wf = SecAggPlusWorkflow(1.0, 0.6, max_weight=1.0, clipping_range=8.0, quantization_range=2 ** 28,
                            modulus_range=2 ** 32, timeout=5)
    plan = _Instructions({100 + k: FitIns(Parameters([], "numpy.ndarray"), {
        "fedhisto-site": s, "fedhisto-round": 0, "fedhisto-key": "terms", "fedhisto-weight": 1.0,
        "fedhisto-clip": 8.0}) for k, s in enumerate(SITES)})
    ctx = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}), strategy=plan)
    ctx.state.config_records["config"] = ConfigRecord({"current_round": 1})
    ctx.state.array_records["parameters"] = ArrayRecord()
    state = WorkflowState()
    assert wf.setup_stage(grid, ctx, state) and wf.share_keys_stage(grid, ctx, state)
    assert wf.collect_masked_vectors_stage(grid, ctx, state)
    with pytest.raises(KeyError, match="104"):  # in-process the ClientApp's error surfaces as the exception
        wf.unmask_stage(grid, ctx, state)


def test_a_site_lost_after_the_statistics_sum_keeps_its_part_in_s(prepared: dict, tmp_path: Path):
    """PAST v2, C5 lost in the weighted sum: the weights are eq. 4's over the five sites that formed S (summing
    S again without C5 would reveal its update), renormalised over the four whose contributions were summed."""
    plain = sites_round(prepared, "past_v2", tmp_path)
    ckpt = local_secure_run(prepared, "past_v2", tmp_path / "flower",
                            on_message=_down_at("collect_masked_vectors", "terms"))
    row = ckpt["history"][0]
    assert row["secure_aggregation"]["statistics"]["summed"] == SITES
    assert row["secure_aggregation"]["terms"]["sites"] == SITES[:4]
    names = sorted(plain["states"])
    d = np.stack([torch.cat([(plain["states"][n][k].double() - plain["starts"][n][k].double()).flatten()
                             for k in sorted(plain["starts"][n])]).numpy() for n in names])
    five = dict(zip(names, eq4([plain["counts"][n] for n in names], d), strict=True))
    four = {n: five[n] / sum(five[m] for m in SITES[:4]) for n in SITES[:4]}
    assert row["weights"] == pytest.approx(four, abs=1e-7)
    _assert_pairs_match(ckpt["members"]["global"], _reference({n: plain["states"][n] for n in SITES[:4]}, four),
                        row["secure_aggregation"]["terms"]["bound"])


def test_the_fast_path_refuses_secure_aggregation_by_name(prepared: dict, monkeypatch):
    from flwr.app import ConfigRecord, RecordDict

    import fedhisto.cli as cli
    from fedhisto.federation.handlers import handle
    from fedhisto.federation.records import state_record
    from fedhisto.methods import build_method
    from fedhisto.model.build import build_model

    cfg = secure_cfg(prepared, ("fedavg_peft",))
    start = build_model(cfg, build_method("fedavg_peft", cfg), 11, None).trainable_state()
    content = RecordDict({"run": ConfigRecord({"method": "fedavg_peft", "seed": 11, "config": cfg.model_dump_json(),
                                               "round": 0, "site": "C1", "k": 0}),
                          "start": state_record(start), "payload#keys": ConfigRecord({"keys": []})})
    node = {"site-id": "C1", "manifest": str(prepared["manifest"]), "descriptors": str(prepared["descriptors"])}
    reply = handle("train", content, node, {})  # the fast path's worker: no Context
    assert "fast path" in str(reply["error"]["message"]) and "state" not in reply
    stage = RecordDict({"secaggplus_configs": ConfigRecord({"stage": "setup"})})
    assert "SecAgg+" in str(handle("train", stage, node, {})["error"]["message"])
    monkeypatch.setattr(cli, "_flower", lambda: None)
    with pytest.raises(ValueError, match=r"--secure-aggregation .* drop --fastpath"):
        cli.main(["federate", "--fastpath", "--secure-aggregation", "--dataset-identity", "x"])


# ------------------------------------------------------------------ stock processes
def test_deployment_secure_aggregation_tls_auth_and_a_killed_supernode(prepared: dict, tmp_path: Path):
    """A SuperLink and five SuperNodes on localhost, TLS and SuperNode authentication, every process Flower's own
    (``fedhisto site`` without --fastpath), with ``--secure-aggregation`` (``secure-aggregation = true``):
    one round each of fedavg_peft and past_v2 in CI's Flower lane.

    fedavg_peft is both the FedAvg-PEFT run and the product-form method this proof needs: its server step
    is delta-SVD, which needs the weighted sum of the products s B_k A_k, so each site masks its dense
    product per adapted module, not its factors. past_v2 adds a statistics sum (its adaptive weights), the
    weighted sum of the products and a prototype sum. fedex_lora (factors and products, the fold) is an
    extra, run only with FEDHISTO_SECURE_ALL=1 (about 2.5 min more; the in-process LocalGrid tests above
    cover it in every Flower lane run). 347 s for the two CI runs on the shared 2-core machine at load 10.

    In fedavg_peft's masked sum C5's SuperNode is SIGKILLed once the collect stage is sent: SecAgg+ unmasks
    the four survivors' sum, which equals the equations over them; C5 rejoins for the others. Each aggregate
    equals the equations on the sites' own states within the bound, and the coordinator's audit shows no
    reply with a state, upload or loss."""
    import yaml
    from test_flower import HANG_S, _wait_for

    from fedhisto.federation import APP_DIR
    from fedhisto.federation.deploy import (
        Procs,
        flower_env,
        flwr_cli,
        free_port,
        make_site_key,
        make_tls,
        run_config_arg,
        superlink_cmd,
        supernode_cmd,
        wait_port,
        write_connection,
    )

    t0 = time.time()
    wd = tmp_path
    raw = yaml.safe_load(Path(prepared["config"]).read_text())
    raw["train"] = {**raw["train"], "max_rounds": 1}
    (wd / "config.yaml").write_text(yaml.safe_dump(raw))
    tls = make_tls(wd / "certs")
    keys = {s: make_site_key(wd / "keys", s) for s in SITES}
    port = free_port()
    home = wd / "flwr_home"
    write_connection(home, "lab", f"127.0.0.1:{port}", root_certificates=tls["ca"])
    env = flower_env(home)
    procs = Procs(wd / "logs", env)
    timings: dict[str, float] = {}
    plain = {m: sites_round(prepared, m, wd / "reference") for m in ("fedavg_peft", "past_v2", "fedex_lora")
             if m != "fedex_lora" or os.environ.get("FEDHISTO_SECURE_ALL")}
    timings["references_s"] = round(time.time() - t0, 1)

    def start_node(s: str) -> None:
        procs.start(f"supernode_{s}", supernode_cmd(f"127.0.0.1:{port}", s, prepared["manifest"],
                                                    prepared["descriptors"], tls["ca"], keys[s][0],
                                                    runtime_port=free_port(), cache_dir=wd / "cache" / s))

    def run(method: str, kill=None) -> Path:
        out, logs = wd / f"results/train/{method}/seed11", wd / f"serverapp_{method}"
        rc = {"method": method, "seed": 11, "config": str(wd / "config.yaml"), "descriptors": str(prepared["descriptors"]),
              "out-dir": str(out), "dataset-identity": prepared["dataset_identity"], "log-dir": str(logs),
              "round-timeout": 240.0, "secure-aggregation": True, "secure-timeout": 20.0}
        t1 = time.time()
        flwr_cli(["run", str(APP_DIR), "lab", "--run-config", run_config_arg(rc), "--format", "json"], env, cwd=wd)
        if kill is not None:
            kill(logs)
        _wait_for(lambda: any(e["event"] in ("finished", "failed") for e in events(logs / "events.jsonl")), HANG_S,
                  f"{method} run end", poll=1.0)
        timings[f"{method}_s"] = round(time.time() - t1, 1)
        evs = events(logs / "events.jsonl")
        assert not [e for e in evs if e["event"] == "failed"], evs[-3:]
        assert_clear_audit(evs)
        return out

    def kill_c5_in_collect(logs: Path) -> None:
        _wait_for(lambda: [e for e in events(logs / "events.jsonl") if e["event"] == "secagg_stage"
                           and e["key"] == "terms" and e["stage"] == "collect_masked_vectors"], HANG_S, "collect stage",
                  poll=0.1)
        procs.stop("supernode_C5", sig=signal.SIGKILL)  # its ClientApp for the collect stage is still starting

    try:
        procs.start("superlink", superlink_cmd(port, tls=tls, database=wd / "superlink.db"))
        wait_port(port)
        for s in SITES:
            flwr_cli(["supernode", "register", str(keys[s][1]), "lab", "--name", s, "--format", "json"], env)
            start_node(s)
        timings["federation_up_s"] = round(time.time() - t0, 1)
        outs = {"fedavg_peft": run("fedavg_peft", kill=kill_c5_in_collect)}
        start_node("C5")  # rejoins under its registered name
        outs["past_v2"] = run("past_v2")
        if os.environ.get("FEDHISTO_SECURE_ALL"):  # FedEx-LoRA's factors + products (about 2.5 min more)
            outs["fedex_lora"] = run("fedex_lora")
    finally:
        leftover = procs.stop_all()
        timings["total_s"] = round(time.time() - t0, 1)
        (wd / "timings.json").write_text(json.dumps(timings))
        print("timings", timings)
    assert leftover == []
    from fedhisto.fedmath.lora_aggregators.fold import folded_key

    for method, out in outs.items():
        ckpt = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
        row, got = ckpt["history"][0], ckpt["members"]["global"]
        survivors = row["secure_aggregation"]["terms"]["sites"]
        bound = row["secure_aggregation"]["terms"]["bound"]
        assert json.loads((out / "status.json").read_text())["status"] == "finalised"
        states = {n: plain[method]["states"][n] for n in survivors}
        if method == "fedavg_peft":
            assert survivors == SITES[:4] and "collect_masked_vectors" in row["unavailable_clients"]["C5"]
            assert row["weights"] == pytest.approx(sample_mass(plain[method]["counts"], survivors), abs=1e-15)
        else:
            assert survivors == SITES and row["unavailable_clients"] == {}
        ref = _reference(states, row["weights"])
        if method == "fedex_lora":
            for key, want in ref.items():
                have = (got[folded_key(key)].double()
                        + 2.0 * got[key.replace("lora_A", "lora_B")].double() @ got[key].double()
                        if ".lora_A." in key else got[key].double())
                assert float((have - want).abs().max()) <= 4 * bound + 2e-7 * float(want.abs().max()), key
        else:
            _assert_pairs_match(got, ref, bound)
    shutil.rmtree(wd / "flwr_home", ignore_errors=True)


def test_a_false_run_config_flag_is_false_on_the_wire_and_at_the_server_app():
    """``fedhisto federate`` passes every run-config key; a boolean must reach the ServerApp as a boolean."""
    from flwr.common.config import parse_config_args

    from fedhisto.config.study import load_config
    from fedhisto.federation.deploy import run_config_arg
    from fedhisto.federation.server_app import secure_config

    values = {"secure-aggregation": False, "sealed": True, "method": "past_v2", "round-timeout": 900.0}
    assert parse_config_args([run_config_arg(values)]) == values
    cfg = load_config({})
    assert not secure_config(cfg, {"secure-aggregation": "False"}).secure_aggregation.enabled
    assert secure_config(cfg, {"secure-aggregation": True}).secure_aggregation.enabled
