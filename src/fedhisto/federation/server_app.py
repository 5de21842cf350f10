"""The ServerApp: ``server.FederatedRun`` driven through Flower's Grid (deployment or Simulation Engine).

Run config (``[tool.flwr.app.config]`` of the app, overridden by ``flwr run --run-config``):
``method``, ``seed``, ``config`` (the coordinator's config YAML), ``out-dir``
(results/train/{method}/seed{seed}), ``dataset-identity``, ``descriptors`` (stain-stage JSON: vectors
only), ``sites``, ``eval-site``, timeouts, and for the Simulation Engine ``sim-manifest`` /
``sim-descriptors`` (virtual nodes have no node config). Sites are found by the name their key was
registered under (``flwr supernode register --name C1``, bound to the key by the SuperLink); where
nodes have no name (simulation) by one ``query`` message.

File-open audit: this module installs a ``sys.addaudithook`` when imported (only the ServerApp's
process imports it) and, with ``log-dir`` set, dumps every path the process opened to
``{log-dir}/serverapp_open_audit.{pid}.json``; the deployment test asserts none is an image.
"""

from __future__ import annotations

import json
import os
import sys

_OPENED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and args and isinstance(args[0], str | bytes | os.PathLike) and len(_OPENED) < 200_000:
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)

import time  # noqa: E402
from pathlib import Path  # noqa: E402

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from fedhisto.entry import study_config_file  # noqa: E402
from fedhisto.federation.envelope import seal, unseal  # noqa: E402
from fedhisto.federation.evaluate import EvaluationIncomplete  # noqa: E402
from fedhisto.federation.server import FederatedRun  # noqa: E402
from fedhisto.train.loop import ClientFailure, ClientUnavailable, TooManyUnavailable  # noqa: E402

app = ServerApp()


def dump_audit(log_dir: str) -> None:
    if not log_dir:
        return
    path = Path(log_dir) / f"serverapp_open_audit.{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "argv": sys.argv, "opened": list(_OPENED)}))
    os.replace(tmp, path)


class GridExchange:
    """``Exchange`` over a Flower Grid: one message per site, replies mapped back by message id
    (SuperLink-made error replies, e.g. NODE_UNAVAILABLE, carry ``src_node_id`` 0).

    Replies are collected by pushing the messages, then pulling every ``poll`` seconds (default 0.2):
    Flower 1.42's ``Grid.send_and_receive`` sleeps a fixed 3 s between pulls
    (``flwr/superlink/grid/http_grid.py``), so a reply that arrives just after a pull waits up to 3 s.
    ``poll=None`` uses ``send_and_receive`` as before (and a Grid without push/pull, e.g. a test's)."""

    def __init__(self, grid: Grid, sites: list[str], timeout: float, wait_nodes: float, run_base: dict,
                 poll: float | None = 0.2, sealed: bool = True):
        self.grid, self.sites, self.timeout, self.wait_nodes = grid, sites, timeout, wait_nodes
        self.sealed = sealed  # each message's content travels as one array (records.seal)
        self.run_base = run_base
        self.poll = poll if poll and hasattr(grid, "push_messages") and hasattr(grid, "pull_messages") else None
        self.site_to_node: dict[str, int] = {}
        self.reply_info: dict[str, dict] = {}  # the last reply's ``info`` record per site (timings)

    def _send_and_receive(self, messages: list[Message]) -> list[Message]:
        from fedhisto.federation.secagg import PollingGrid  # the same push-then-poll the SecAgg+ stages use

        return PollingGrid(self.grid, self.poll).send_and_receive(messages, timeout=self.timeout)

    def discover(self) -> dict[str, int]:
        """Map sites to node ids: registered names first; nameless nodes answer one ``query``."""
        t0 = time.time()
        while time.time() - t0 < self.wait_nodes:
            nodes = {n.node_id: n for n in self.grid.get_nodes()}
            named = {n.name: nid for nid, n in nodes.items() if getattr(n, "name", "") in self.sites}
            if len(named) == len(self.sites) or len(nodes) >= len(self.sites):
                break
            time.sleep(1.0)
        self.site_to_node = dict(named)
        unnamed = [nid for nid in nodes if nid not in named.values()]
        if unnamed and len(named) < len(self.sites):
            msgs = [Message(RecordDict({"run": ConfigRecord({**self.run_base, "site": "", "round": -1, "k": -1})}),
                            dst_node_id=nid, message_type="query") for nid in unnamed]
            for reply in self._send_and_receive(msgs):
                if not reply.has_error() and "site" in reply.content:
                    site = str(reply.content["site"]["site-id"])
                    if site in self.site_to_node and self.site_to_node[site] != reply.metadata.src_node_id:
                        raise RuntimeError(f"two nodes claim site {site}")
                    self.site_to_node[site] = reply.metadata.src_node_id
        return self.site_to_node

    def send(self, action: str, contents: dict[str, RecordDict], round_idx: int):
        if len(self.site_to_node) < len(self.sites):
            self.discover()
        unavailable = {s: "no SuperNode for this site is connected" for s in contents if s not in self.site_to_node}
        msgs = {s: Message(seal(rd) if self.sealed else rd, dst_node_id=self.site_to_node[s], message_type=action,
                           group_id=str(round_idx + 1))
                for s, rd in contents.items() if s in self.site_to_node}
        replies = self._send_and_receive(list(msgs.values())) if msgs else []
        by_id = {m.metadata.message_id: s for s, m in msgs.items()}
        got: dict[str, RecordDict] = {}
        for reply in replies:
            site = by_id.get(reply.metadata.reply_to_message_id)
            if site is None:
                continue
            if reply.has_error():  # NODE_UNAVAILABLE, or the ClientApp could not even start
                unavailable[site] = f"Flower error {reply.error.code}: {reply.error.reason}"[:500]
            else:
                got[site] = unseal(reply.content)
                if "info" in got[site]:
                    self.reply_info[site] = dict(got[site]["info"])
        for s in msgs:
            if s not in got and s not in unavailable:
                unavailable[s] = f"no reply within {self.timeout:.0f} s"
        return got, unavailable


def evaluation_targets(value: str) -> list:
    """Run config ``evaluate``: ``SITE:split`` items, comma-separated (e.g. ``C1:holdout,TEST:test,EXT:external``)."""
    from fedhisto.federation.evaluate import EvalTarget

    out = []
    for item in (x.strip() for x in value.split(",") if x.strip()):
        site, sep, split = item.partition(":")
        if not sep:
            raise ValueError(f"run config evaluate: {item!r} is not SITE:split")
        out.append(EvalTarget(site, split))
    return out


def run_flag(value) -> bool:
    """A boolean run-config value: TOML's true/false, or a string that spells one ("False" is false)."""
    if isinstance(value, str):
        if value.strip().lower() not in ("true", "false", "1", "0", ""):
            raise ValueError(f"run config: {value!r} is not true or false")
        return value.strip().lower() in ("true", "1")
    return bool(value)


def secure_config(cfg, rc: dict):
    """Run config ``secure-aggregation = true`` (``fedhisto federate --secure-aggregation``) turns on the
    config's ``secure_aggregation`` block, its settings as the config file gives them; the run's method
    is then checked by ``server.check_federable`` (its own declaration)."""
    if not run_flag(rc.get("secure-aggregation", False)) or cfg.secure_aggregation.enabled:
        return cfg
    return cfg.model_copy(update={"secure_aggregation": cfg.secure_aggregation.model_copy(update={"enabled": True})})


def _sites(value: str) -> list[str]:
    return sorted(s.strip() for s in str(value).split(",") if s.strip())


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = dict(context.run_config)
    log_dir = str(rc.get("log-dir", ""))
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    cfg = secure_config(study_config_file(str(rc["config"])), rc)
    sites = _sites(rc["sites"])
    fed = FederatedRun(cfg, str(rc["method"]), int(rc["seed"]), sites, str(rc["out-dir"]),
                       str(rc["dataset-identity"]), str(rc["descriptors"]),
                       encoder_dir=str(rc.get("encoder-dir", "")) or None, eval_site=str(rc.get("eval-site", "")) or None,
                       events=Path(log_dir) / "events.jsonl" if log_dir else None,
                       pause_between_rounds=float(rc.get("pause-between-rounds", 0.0)))
    fed.after_round = lambda: dump_audit(log_dir)
    fed.secure_timeout = float(rc.get("secure-timeout", 120.0))
    run_base = {"method": fed.method.name, "seed": fed.seed, "config": fed.cfg_json}
    poll = float(rc.get("poll-interval", 0.2))
    targets = evaluation_targets(str(rc.get("evaluate", "")))
    reached = sorted({*sites, *fed.eval_sites, *(t.site for t in targets)})
    ex = GridExchange(grid, reached, float(rc.get("round-timeout", 600.0)), float(rc.get("wait-nodes", 120.0)),
                      run_base, poll=poll if poll > 0 else None, sealed=run_flag(rc.get("sealed", True)))
    try:
        ex.discover()
        fed._event(event="discovered", site_to_node={k: str(v) for k, v in ex.site_to_node.items()})
        ckpt = fed.run(ex)
        fed.finalise(ex, ckpt)
        if targets:
            fed.evaluate(ex, ckpt, targets, str(rc["predictions-dir"]))
        fed._event(event="finished", round=ckpt["round"])
    except (ClientFailure, TooManyUnavailable) as exc:
        fed.fail(exc)
        fed._event(event="failed", error=str(exc)[:2000])
        raise
    except EvaluationIncomplete as exc:  # training is done and kept; evaluation names the sites that failed
        fed._event(event="evaluation_incomplete", failed=exc.failed)
        raise
    except ClientUnavailable as exc:  # the evaluation site is away: the checkpoint stays; run again to resume
        fed._event(event="interrupted", error=str(exc)[:2000])
        raise
    finally:
        dump_audit(log_dir)
