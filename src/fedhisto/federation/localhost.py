"""A whole federation on one host: SuperLink (TLS + SuperNode authentication), registered sites,
their SuperNodes and workers, ``flwr run``. For the deployment tests and the round benchmark; a
real deployment runs the same commands on different machines (docs/federation.md, runbook).

``fast=True`` is the deployment as ``fedhisto site`` starts it (a long-lived worker per site, the
SuperNode's idle poll capped at 0.2 s, SuperExecs polling every 0.1 s, the ServerApp pulling every
0.2 s); ``fast=False`` is Flower's own process model and polling (one ClientApp process per message
that imports everything and decodes the site's images, 3 s / 1 s / 3 s polls), kept to measure
against.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

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
    worker_cmd,
    write_connection,
)


@dataclass
class SiteSpec:
    """What one site's SuperNode is started with (its own files only)."""

    site: str
    manifest: Path
    descriptors: Path | str = ""
    encoder_dir: str = ""
    # the worker's warm-up (fast only; ``worker.serve``): the federation's config, splits, METHOD:SEED runs
    warm_config: Path | str = ""
    warm_splits: tuple[str, ...] = ("optimisation",)
    warm_runs: tuple[str, ...] = ()


@dataclass
class LocalFederation:
    root: Path
    sites: list[SiteSpec]
    fast: bool = True
    procs: Procs = field(init=False)
    port: int = field(init=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.tls = make_tls(self.root / "certs")
        self.keys = {s.site: make_site_key(self.root / "keys", s.site) for s in self.sites}
        self.port = free_port()
        home = self.root / "flwr_home"
        write_connection(home, "lab", f"127.0.0.1:{self.port}", root_certificates=self.tls["ca"])
        extra = {} if self.fast else {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "1.0"}  # Flower's default
        self.env = flower_env(home, extra=extra)
        self.procs = Procs(self.root / "logs", self.env)
        self.node_ids: dict[str, int] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_superlink(self) -> None:
        self.procs.start("superlink", superlink_cmd(self.port, tls=self.tls, database=self.root / "superlink.db"))
        wait_port(self.port)

    def register(self) -> None:
        """``flwr supernode register`` for every site, concurrently (each is a CLI process start)."""
        from concurrent.futures import ThreadPoolExecutor

        def one(site: str) -> tuple[str, int]:
            out = flwr_cli(["supernode", "register", str(self.keys[site][1]), "lab", "--name", site,
                            "--format", "json"], self.env)
            return site, json_out(out)["node-id"]

        with ThreadPoolExecutor(len(self.sites)) as pool:
            self.node_ids.update(pool.map(one, [s.site for s in self.sites]))

    def start_site(self, spec: SiteSpec) -> None:
        run_dir = self.root / "sites" / spec.site
        sock, cache = (run_dir / "worker.sock", run_dir / "cache") if self.fast else ("", "")
        if self.fast:
            ready = run_dir / "worker.ready"
            ready.unlink(missing_ok=True)
            self.procs.start(f"worker_{spec.site}", worker_cmd(sock, spec.site, spec.manifest, spec.descriptors,
                                                               spec.encoder_dir, cache, ready_file=ready,
                                                               warm_config=spec.warm_config,
                                                               warm_splits=spec.warm_splits, warm_runs=spec.warm_runs))
        self.procs.start(f"supernode_{spec.site}", supernode_cmd(
            self.address, spec.site, spec.manifest, spec.descriptors, self.tls["ca"], self.keys[spec.site][0],
            runtime_port=free_port(), encoder_dir=spec.encoder_dir, worker=sock, cache_dir=cache,
            fast_poll=self.fast))

    def wait_workers(self, timeout: float = 180.0) -> None:
        if self.fast:
            wait_for(lambda: all((self.root / "sites" / s.site / "worker.ready").exists() for s in self.sites),
                     timeout, "site workers ready")

    def start(self) -> None:
        self.start_superlink()
        self.register()
        for s in self.sites:
            self.start_site(s)
        self.wait_workers()

    def run(self, run_config: dict) -> None:
        rc = {**run_config, "poll-interval": 0.2 if self.fast else 0.0}
        flwr_cli(["run", str(APP_DIR), "lab", "--run-config", run_config_arg(rc), "--format", "json"], self.env,
                 cwd=self.root)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of each started process with its descendants (Linux
        /proc; children already reaped are counted in their parent's cutime/cstime)."""
        from fedhisto.federation.deploy import descendants

        tick = os.sysconf("SC_CLK_TCK")

        def cpu(pid: int) -> float:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    f = fh.read().rsplit(")", 1)[1].split()
                return sum(int(x) for x in f[11:15]) / tick  # utime, stime, cutime, cstime
            except (OSError, ValueError, IndexError):
                return 0.0

        return {name: round(cpu(p.pid) + sum(cpu(k) for k in descendants(p.pid)), 1)
                for name, p in self.procs.procs.items()}

    def stop(self) -> list[int]:
        return self.procs.stop_all()


def wait_for(pred, timeout: float, what: str, poll: float = 0.5):
    t0 = time.time()
    while time.time() - t0 < timeout:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def events(log_dir: Path) -> list[dict]:
    p = Path(log_dir) / "events.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def wait_run_end(log_dir: Path, timeout: float) -> dict:
    """The ``finished`` / ``failed`` / ``interrupted`` event of the ServerApp's run."""
    return wait_for(lambda: next((e for e in events(log_dir) if e["event"] in ("finished", "failed", "interrupted")),
                                 None), timeout, "run end", poll=0.5)
