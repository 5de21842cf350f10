"""The fast path's process command lines: a site's worker and its SuperNode through ``supernode_poll``.

Both are refused on a Flower the fast path is not tested against (``fastpath.require``), before any
process starts. The stock command lines are ``federation.deploy``'s; these wrap them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedhisto.federation.deploy import node_config_items
from fedhisto.federation.deploy import supernode_cmd as stock_supernode_cmd
from fedhisto.federation.fastpath import require


def supernode_cmd(superlink: str, site: str, manifest: str | Path, descriptors: str | Path = "",
                  root_certificates: str | Path | None = None, auth_key: str | Path | None = None,
                  runtime_port: int = 9094, insecure: bool = False, encoder_dir: str = "", threads: int = 1,
                  worker: str | Path = "", cache_dir: str | Path = "", report: str = "rows") -> list[str]:
    """``deploy.supernode_cmd`` run through ``supernode_poll`` (idle poll capped at
    FEDHISTO_SUPERNODE_POLL_S, default 0.2 s, instead of Flower's fixed 3 s; shorter object pulls);
    ``worker``: the site worker's socket, which the SuperExec's ``flwr-clientapp`` then hands each
    task to (``clientapp_launcher``)."""
    require()
    stock = stock_supernode_cmd(superlink, site, manifest, descriptors, root_certificates, auth_key, runtime_port,
                                insecure, encoder_dir, threads, cache_dir, report)
    exe = [sys.executable, "-m", "fedhisto.federation.fastpath.supernode_poll"]
    if worker:
        exe += ["--site-worker", str(Path(worker).resolve())]
    return [*exe, *stock[1:]]  # Flower's own arguments, after ours


def worker_cmd(socket_path: str | Path, site: str, manifest: str | Path, descriptors: str | Path = "",
               encoder_dir: str = "", cache_dir: str | Path = "", threads: int = 1,
               parent_pid: int | None = None, ready_file: str | Path | None = None, report: str = "rows",
               warm_config: str | Path = "", warm_splits: tuple[str, ...] = ("optimisation",),
               warm_runs: tuple[str, ...] = ()) -> list[str]:
    """The site worker (``fastpath.worker``) for the node config the SuperNode gets. ``warm_config``:
    the federation's config file, to load the encoder and the site's images of ``warm_splits`` (and
    build the model of each ``METHOD:SEED`` of ``warm_runs``) before the worker says ready."""
    require()
    items = node_config_items(site, manifest, descriptors, encoder_dir, cache_dir, report)
    items["threads"] = threads  # type: ignore[assignment]
    cmd = [sys.executable, "-m", "fedhisto.federation.fastpath.worker", "--socket", str(Path(socket_path).resolve()),
           "--node-config", json.dumps(items)]
    if parent_pid:
        cmd += ["--parent-pid", str(parent_pid)]
    if ready_file:
        cmd += ["--ready-file", str(ready_file)]
    if warm_config:
        cmd += ["--warm-config", str(Path(warm_config).resolve()), "--warm-splits", ",".join(warm_splits)]
        for run in warm_runs:
            cmd += ["--warm-run", run]
    elif warm_runs:
        raise ValueError(f"site {site}: warm runs {list(warm_runs)} need the federation's config (warm_config)")
    return cmd
