"""A whole federation on one host: SuperLink (TLS + SuperNode authentication), registered sites,
their SuperNodes and workers, ``flwr run``. For the deployment tests and the round benchmark; a
real deployment runs the same commands on different machines (docs/federation.md, runbook).

By default every process is Flower's own, as ``fedhisto site`` / ``federate`` start them:
``flower-superlink``, ``flower-supernode`` and one ``flwr-clientapp`` process per message (it
imports everything and reads the site's decoded images from the node cache), with Flower's
documented settings only (SuperExecs polling every 0.1 s, the ServerApp pulling replies every 0.2 s
through the Grid's push/pull). ``fastpath=True`` is ``--fastpath`` (``federation.fastpath``: a
long-lived worker per site, the SuperNode's idle poll capped at 0.2 s, shorter object pulls), refused
on a Flower the fast path is not tested against.
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
    write_connection,
)


@dataclass
class SiteSpec:
    """What one site's SuperNode is started with (its own files only)."""

    site: str
    manifest: Path
    descriptors: Path | str = ""
    encoder_dir: str = ""
    # the worker's warm-up (fast path only; ``worker.serve``): the federation's config, splits, METHOD:SEED runs
    warm_config: Path | str = ""
    warm_splits: tuple[str, ...] = ("optimisation",)
    warm_runs: tuple[str, ...] = ()


@dataclass
class LocalFederation:
    root: Path
    sites: list[SiteSpec]
    fastpath: bool = False
    procs: Procs = field(init=False)
    port: int = field(init=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.fastpath:
            from fedhisto.federation.fastpath import require

            require()  # before any process starts
        self.tls = make_tls(self.root / "certs")
        self.keys = {s.site: make_site_key(self.root / "keys", s.site) for s in self.sites}
        self.port = free_port()
        home = self.root / "flwr_home"
        write_connection(home, "lab", f"127.0.0.1:{self.port}", root_certificates=self.tls["ca"])
        self.env = flower_env(home)
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
        sock, cache = run_dir / "worker.sock", run_dir / "cache"
        args = (self.address, spec.site, spec.manifest, spec.descriptors, self.tls["ca"], self.keys[spec.site][0])
        if not self.fastpath:
            self.procs.start(f"supernode_{spec.site}", supernode_cmd(*args, runtime_port=free_port(),
                                                                     encoder_dir=spec.encoder_dir, cache_dir=cache))
            return
        from fedhisto.federation.fastpath import launch_commands as commands

        ready = run_dir / "worker.ready"
        ready.unlink(missing_ok=True)
        self.procs.start(f"worker_{spec.site}", commands.worker_cmd(
            sock, spec.site, spec.manifest, spec.descriptors, spec.encoder_dir, cache, ready_file=ready,
            warm_config=spec.warm_config, warm_splits=spec.warm_splits, warm_runs=spec.warm_runs))
        self.procs.start(f"supernode_{spec.site}", commands.supernode_cmd(
            *args, runtime_port=free_port(), encoder_dir=spec.encoder_dir, worker=sock, cache_dir=cache))

    def wait_workers(self, timeout: float = 180.0) -> None:
        if self.fastpath:
            wait_for(lambda: all((self.root / "sites" / s.site / "worker.ready").exists() for s in self.sites),
                     timeout, "site workers ready")

    def start(self) -> None:
        self.start_superlink()
        self.register()
        for s in self.sites:
            self.start_site(s)
        self.wait_workers()

    def run(self, run_config: dict) -> None:
        from fedhisto.federation.fastpath import APP_DIR as FASTPATH_APP_DIR

        app = FASTPATH_APP_DIR if self.fastpath else APP_DIR
        rc = {"poll-interval": 0.2, **run_config}
        flwr_cli(["run", str(app), "lab", "--run-config", run_config_arg(rc), "--format", "json"], self.env,
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
