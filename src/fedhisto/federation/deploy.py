"""Flower processes, certificates and keys, as the CLI (``fedhisto superlink/site/federate``) and tests use them.

Deployment defaults (Flower 1.40-1.42, stock processes): one HTTPS port on the SuperLink for Fleet,
Control and Runtime APIs; TLS with a CA the sites trust; SuperNode authentication by keys the coordinator registers
(``flwr supernode register <site>.pub <conn> --name <site>``: the name is how the ServerApp finds a
site). Turning TLS/authentication off needs ``insecure=True`` (``--insecure`` on the CLI).

Process hygiene: every process starts in its own session with ``FEDHISTO_FLWR_TAG`` in its
environment; ``Procs.stop_all`` stops each started process, its process group and descendants
(including the SuperLink's detached SuperExec and the ServerApp), then anything still tagged.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from fedhisto.infra.processes import running

TAG_VAR = "FEDHISTO_FLWR_TAG"


# ------------------------------------------------------------------------- certificates and keys
def make_tls(cert_dir: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 30) -> dict[str, Path]:
    """A CA and a SuperLink server certificate for ``hosts`` (ECDSA P-256). For tests and pilots; a
    production SuperLink uses a certificate from the institution's CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(cert_dir)
    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key, srv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedhisto federation CA")])

    def builder(subject, key):
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=days)))

    ca = builder(ca_name, ca_key).add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    ca = ca.sign(ca_key, hashes.SHA256())
    sans = [x509.IPAddress(ipaddress.ip_address(h)) if h.replace(".", "").isdigit() else x509.DNSName(h) for h in hosts]
    srv = (builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]), srv_key)
           .add_extension(x509.SubjectAlternativeName(sans), critical=False)
           .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
           .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
           .sign(ca_key, hashes.SHA256()))
    paths = {"ca": d / "ca.crt", "cert": d / "server.pem", "key": d / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    _write_private(paths["key"], srv_key.private_bytes(serialization.Encoding.PEM,
                                                       serialization.PrivateFormat.TraditionalOpenSSL,
                                                       serialization.NoEncryption()))
    return paths


def make_site_key(key_dir: str | Path, site: str) -> tuple[Path, Path]:
    """A SuperNode's authentication key pair (EC P-384, OpenSSH formats; = ``ssh-keygen -t ecdsa -b 384``).
    The private key stays at the site; the public key goes to the coordinator to register."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    d = Path(key_dir)
    d.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    priv, pub = d / site, d / f"{site}.pub"
    _write_private(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return priv, pub


def _write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


# ------------------------------------------------------------------------- command lines
def flower_bin(name: str) -> str:
    """A Flower executable next to this Python (the venv with fedhisto[federation]), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found: pip install -e \".[federation]\"")
    return found


def superlink_cmd(port: int, host: str = "127.0.0.1", tls: dict | None = None, database: str | Path | None = None,
                  insecure: bool = False) -> list[str]:
    cmd = [flower_bin("flower-superlink"), "--host", host, "--port", str(port),
           "--disable-runtime-dependency-installation"]
    if insecure:
        cmd.append("--insecure")
    else:
        if not tls:
            raise ValueError("a SuperLink needs TLS (ca, cert, key) and SuperNode authentication unless insecure")
        cmd += ["--ssl-ca-certfile", str(tls["ca"]), "--ssl-certfile", str(tls["cert"]), "--ssl-keyfile", str(tls["key"]),
                "--enable-supernode-auth"]
    if database:
        cmd += ["--database", str(database)]  # keeps registrations and node ids across a restart
    return cmd


def node_config(site: str, manifest: str | Path, descriptors: str | Path = "", encoder_dir: str = "",
                threads: int = 1, cache_dir: str | Path = "", report: str = "rows") -> str:
    """The SuperNode's ``--node-config``. ``cache_dir``: the node-local cache of decoded images
    (``site.load_site_split``); ``report``: ``counts`` is the site's opt-out of per-image evaluation
    rows (``federation.evaluate``)."""
    items = node_config_items(site, manifest, descriptors, encoder_dir, cache_dir, report)
    return " ".join(f"{k}='{v}'" for k, v in items.items()) + f" threads={threads}"


def node_config_items(site: str, manifest: str | Path, descriptors: str | Path = "", encoder_dir: str = "",
                      cache_dir: str | Path = "", report: str = "rows") -> dict[str, str]:
    if report not in ("rows", "counts"):
        raise ValueError(f"site {site}: report {report!r} is not rows or counts")
    items = {"site-id": site, "manifest": str(Path(manifest).resolve()),
             "descriptors": str(Path(descriptors).resolve()) if descriptors else "", "encoder-dir": encoder_dir}
    if cache_dir:
        items["cache-dir"] = str(Path(cache_dir).resolve())
    if report != "rows":
        items["report"] = report
    return items


def supernode_cmd(superlink: str, site: str, manifest: str | Path, descriptors: str | Path = "",
                  root_certificates: str | Path | None = None, auth_key: str | Path | None = None,
                  runtime_port: int = 9094, insecure: bool = False, encoder_dir: str = "", threads: int = 1,
                  cache_dir: str | Path = "", report: str = "rows") -> list[str]:
    """Flower's own ``flower-supernode`` for this site (the fast path's SuperNode: ``fastpath.commands``)."""
    cmd = [flower_bin("flower-supernode"), "--superlink", superlink,
           "--node-config", node_config(site, manifest, descriptors, encoder_dir, threads, cache_dir, report),
           "--host", "127.0.0.1", "--port", str(runtime_port)]  # the SuperNode's local runtime API (one per node)
    if insecure:
        cmd.append("--insecure")
    else:
        if not (root_certificates and auth_key):
            raise ValueError("a SuperNode needs --root-certificates and --auth-key unless insecure")
        cmd += ["--root-certificates", str(root_certificates), "--auth-supernode-private-key", str(auth_key)]
    return cmd


def write_connection(flwr_home: str | Path, name: str, address: str, root_certificates: str | Path | None = None,
                     insecure: bool = False, simulation: dict | None = None) -> Path:
    """``$FLWR_HOME/config.toml`` with one SuperLink connection (Flower 1.42's place for it)."""
    home = Path(flwr_home)
    home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]", f'address = "{address}"']
    if insecure:
        lines.append("insecure = true")
    elif root_certificates:
        lines.append(f'root-certificates = "{Path(root_certificates).resolve()}"')
    if simulation:
        lines += ["", f"[superlink.{name}.options]", f"num-supernodes = {simulation['num_supernodes']}", "",
                  f"[superlink.{name}.options.backend.client-resources]", "num-cpus = 1", "num-gpus = 0.0", "",
                  f"[superlink.{name}.options.backend.init-args]", f"num-cpus = {simulation.get('num_cpus', 2)}",
                  "num-gpus = 0"]
    (home / "config.toml").write_text("\n".join(lines) + "\n")
    return home / "config.toml"


def run_config_arg(values: dict) -> str:
    def fmt(v):
        if isinstance(v, bool):  # a TOML boolean: a quoted 'False' would be a non-empty string, i.e. true
            return "true" if v else "false"
        return repr(v) if isinstance(v, int | float) else f"'{v}'"

    return " ".join(f"{k}={fmt(v)}" for k, v in values.items())


def flower_env(flwr_home: str | Path, tag: str | None = None, extra: dict | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"FLWR_HOME": str(flwr_home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "RAY_DISABLE_USAGE_STATS": "1",
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                # the SuperExecs (SuperLink's and each SuperNode's) look for new tasks every 0.1 s, not 1 s,
                # unless the environment sets Flower's variable (many sites on one host: slower polls cost less)
                "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": env.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1"),
                "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}", TAG_VAR: tag or uuid.uuid4().hex})
    env.update(extra or {})
    return env


# ------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 60.0, host: str = "127.0.0.1") -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return time.time() - t0
        time.sleep(0.2)
    raise TimeoutError(f"port {port} not open after {timeout:.0f} s")


def _signal(pid: int, sig: int) -> None:
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    parents[int(d)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [], [pid]
    while frontier:
        cur = frontier.pop()
        kids = [c for c, p in parents.items() if p == cur]
        out += kids
        frontier += kids
    return out


def tagged_pids(tag: str) -> list[int]:
    marker, out = f"{TAG_VAR}={tag}".encode(), []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as fh:
                    if marker in fh.read() and running(int(d)):
                        out.append(int(d))
            except OSError:
                pass
    return out


class Procs:
    """Started Flower processes (own session each, tagged environment, one log file each)."""

    def __init__(self, log_dir: str | Path, env: dict[str, str]):
        self.log_dir, self.env, self.procs = Path(log_dir), env, {}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.tag = env[TAG_VAR]

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = (self.log_dir / f"{name}.log").open("ab")
        log.write(f"\n===== {time.ctime()} {' '.join(cmd)}\n".encode())
        log.flush()
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True, cwd=self.log_dir)
        return self.procs[name]

    def stop(self, name: str, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
        """Stop one process, its group and descendants; reap it promptly (a zombie parent fools
        Flower's --parent-pid monitors)."""
        p = self.procs.pop(name, None)
        if p is None:
            return
        kids = descendants(p.pid)
        for pid in [p.pid, *kids]:
            _signal(pid, sig)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            _signal(p.pid, signal.SIGKILL)
            p.wait(5)
        deadline = time.time() + grace
        while time.time() < deadline and any(running(k) for k in kids):
            time.sleep(0.2)
        for k in kids:
            if running(k):
                _signal(k, signal.SIGKILL)

    def stop_all(self) -> list[int]:
        """Stop everything; returns the pids still alive afterwards (should be none)."""
        for name in list(self.procs):
            with contextlib.suppress(Exception):  # keep going: the tag sweep below still catches it
                self.stop(name, grace=5.0)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in tagged_pids(self.tag):
                _signal(pid, sig)
            time.sleep(1.0)
        return tagged_pids(self.tag)


def flwr_cli(args: list[str], env: dict[str, str], timeout: float = 180, cwd: str | Path | None = None) -> str:
    r = subprocess.run([flower_bin("flwr"), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if r.returncode != 0:
        raise RuntimeError(f"flwr {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def json_out(text: str) -> dict:
    import json

    return json.loads(text[text.index("{"):])
