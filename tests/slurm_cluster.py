"""A throw-away single-node SLURM cluster built from Debian's packages, for the profile test (issue 7).

Everything lives under one scratch directory: its own munge key and socket, its own MariaDB data
directory, its own slurm.conf/slurmdbd.conf, its own free TCP ports and state directories. Every
process of the cluster, and every command run against it, lives in a private mount namespace in
which that scratch etc/ is bind-mounted on /etc/slurm: the executor's job step strips SLURM_CONF
before its nested srun, so the configuration has to sit at the default path, and the namespace puts
it there without writing to the machine's /etc. A machine that already runs SLURM, MariaDB or munge
is left alone, and stopping the cluster is stopping the processes it started.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

# Debian 12 package names; the test's error message and the README name the same list.
DEBIAN_PACKAGES = ("slurm-wlm", "slurmdbd", "munge", "mariadb-server")
REQUIRED_PROGRAMS = ("unshare", "nsenter", "mount", "munged", "mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "slurmctld", "slurmd",
                     "sbatch", "sacct", "sacctmgr", "squeue", "scancel", "sinfo")
ACCOUNT = "fedhisto"
PARTITION = "debug"
#: the node's one configured GPU: a GRES without a device file (Slurm counts and allocates it; nothing binds a
#: device, so a job on it computes on the CPU), in a partition of its own as on a cluster with GPU nodes
GPU_PARTITION = "gpu"


class ClusterError(RuntimeError):
    """The local cluster could not be brought up; the message names the daemon and its log."""


def missing_programs() -> list[str]:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [p for p in REQUIRED_PROGRAMS if shutil.which(p, path=path) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, what: str, log: Path | None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    raise ClusterError(f"{what} not ready after {timeout:.0f} s; {log}:\n{tail}")


class LocalSlurmCluster:
    """Start munge, MariaDB, slurmdbd, slurmctld and slurmd as children; stop them all on exit."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.env = dict(os.environ, PATH=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
        self.env.pop("SLURM_CONF", None)
        self.namespace: subprocess.Popen | None = None

    def command(self, *cmd: str, cwd: Path | None = None) -> list[str]:
        """cmd as run in cwd inside the cluster's mount namespace (where /etc/slurm is the scratch etc/)."""
        if self.namespace is None:
            return list(cmd)
        # nsenter would otherwise start in /: only /etc/slurm differs between the namespaces
        return ["nsenter", f"--mount=/proc/{self.namespace.pid}/ns/mnt", f"--wd={cwd or self.root}", "--", *cmd]

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> LocalSlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if os.geteuid() != 0:
            raise ClusterError("the local SLURM cluster runs its daemons as root; run the slurm test as root")
        missing = missing_programs()
        if missing:
            raise ClusterError(f"missing programs {missing}: apt-get install -y {' '.join(DEBIAN_PACKAGES)}")
        for sub in ("etc", "log", "run", "munge", "mysql", "spool/ctld", "spool/d"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # munged refuses a socket directory others may write to
        self.munge_socket = self.root / "munge/munge.socket"
        self.ports = {name: _free_port() for name in ("mysql", "dbd", "ctld", "d")}
        self._enter_namespace()
        self._start_munge()
        self._start_mariadb()
        self._write_configs()
        self._start_slurmdbd()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        self._spawn("slurmd", ["slurmd", "-D"])
        _wait(self._node_idle, "slurmd (node idle)", self.root / "log/slurmd.log")

    def stop(self) -> None:
        """Cancel what is left in the queue, then stop the daemons in reverse order of start."""
        if any(name == "slurmctld" for name, _ in self.procs):
            self.run("scancel", "--full", "--partition", f"{PARTITION},{GPU_PARTITION}", check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(1)
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()
        if self.namespace is not None:
            self.namespace.kill()  # the last process in it: the namespace and its bind mount go with it
            self.namespace.wait()
            self.namespace = None

    # -- commands --------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.command(*cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def jobs(self) -> list[dict[str, str]]:
        """Every job accounting knows of: id, name, state, comment (the plugin puts rule and wildcards there)."""
        out = self.run("sacct", "-a", "-X", "-n", "-P", "-S", "2000-01-01",
                       "-o", "JobIDRaw,JobName,State,Comment%200").stdout
        keys = ("id", "name", "state", "comment")
        return [dict(zip(keys, line.split("|", 3), strict=True)) for line in out.splitlines() if line.strip()]

    def queue(self) -> list[dict[str, str]]:
        out = self.run("squeue", "-h", "-o", "%i|%T|%k").stdout
        return [dict(zip(("id", "state", "comment"), line.split("|", 2), strict=True))
                for line in out.splitlines() if line.strip()]

    # -- daemons ---------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = (self.root / f"log/{name}.out").open("ab")
        proc = subprocess.Popen(self.command(*cmd), env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((name, proc))
        time.sleep(0.5)
        if proc.poll() is not None:
            raise ClusterError(f"{name} exited with {proc.returncode} at start; see {self.root}/log/{name}*")
        return proc

    def _enter_namespace(self) -> None:
        if not Path("/etc/slurm").is_dir():
            raise ClusterError("/etc/slurm does not exist: is Debian's slurm-wlm installed?")
        self.namespace = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "infinity"])
        ours = os.readlink("/proc/self/ns/mnt")

        def separate() -> bool:  # never bind-mount before unshare is done: that would hit the machine's /etc
            if self.namespace.poll() is not None:
                raise ClusterError(f"unshare --mount exited with {self.namespace.returncode}: no mount namespaces here?")
            try:
                return os.readlink(f"/proc/{self.namespace.pid}/ns/mnt") != ours
            except OSError:
                return False

        _wait(separate, "private mount namespace", None, timeout=10)
        self.run("mount", "--bind", str(self.root / "etc"), "/etc/slurm")

    def _start_munge(self) -> None:
        key = self.root / "munge/munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={self.root}/run/munged.pid", f"--log-file={self.root}/log/munged.log",
                               f"--seed-file={self.root}/munge/seed"])
        _wait(self.munge_socket.exists, "munged", self.root / "log/munged.log")

    def _mysql(self, sql: str) -> None:
        self.run("mariadb", f"--socket={self.root}/run/mysqld.sock", "-u", "root", "-e", sql)

    def _start_mariadb(self) -> None:
        datadir = self.root / "mysql"
        self.run("mariadb-install-db", f"--datadir={datadir}", "--user=root", "--auth-root-authentication-method=socket",
                 "--skip-test-db", timeout=300)
        self._spawn("mariadbd", ["mariadbd", "--no-defaults", f"--datadir={datadir}", "--user=root",
                                 f"--socket={self.root}/run/mysqld.sock", f"--port={self.ports['mysql']}",
                                 "--bind-address=127.0.0.1", f"--pid-file={self.root}/run/mysqld.pid",
                                 f"--log-error={self.root}/log/mariadb.log", "--innodb-buffer-pool-size=64M"])
        _wait(lambda: self.run("mariadb", f"--socket={self.root}/run/mysqld.sock", "-u", "root", "-e", "SELECT 1",
                               check=False).returncode == 0, "mariadbd", self.root / "log/mariadb.log")
        self._mysql("CREATE DATABASE slurm_acct_db; "
                    "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm'; "
                    "CREATE USER 'slurm'@'localhost' IDENTIFIED BY 'slurm'; "
                    "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; "
                    "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;")

    def _write_configs(self) -> None:
        r, p = self.root, self.ports
        auth = f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket}\n"
        dbd = r / "etc/slurmdbd.conf"
        dbd.write_text(f"{auth}DbdHost=localhost\nDbdPort={p['dbd']}\nSlurmUser=root\n"
                       f"LogFile={r}/log/slurmdbd.log\nPidFile={r}/run/slurmdbd.pid\n"
                       "StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\n"
                       f"StoragePort={p['mysql']}\nStorageUser=slurm\nStoragePass=slurm\nStorageLoc=slurm_acct_db\n")
        dbd.chmod(0o600)  # slurmdbd refuses a config with a password others can read
        mem = max(2048, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 - 2048)
        (r / "etc/slurm.conf").write_text(
            f"ClusterName=fedhisto\nSlurmctldHost={self.host}\nSlurmctldPort={p['ctld']}\n"
            f"SlurmdPort={p['d']}\nSlurmUser=root\n{auth}"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SchedulerType=sched/backfill\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core_Memory\n"
            f"StateSaveLocation={r}/spool/ctld\nSlurmdSpoolDir={r}/spool/d\n"
            f"SlurmctldPidFile={r}/run/slurmctld.pid\nSlurmdPidFile={r}/run/slurmd.pid\n"
            f"SlurmctldLogFile={r}/log/slurmctld.log\nSlurmdLogFile={r}/log/slurmd.log\n"
            f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\n"
            f"AccountingStoragePort={p['dbd']}\nAccountingStoreFlags=job_comment\n"
            # for slurmdbd traffic the munge socket is AccountingStoragePass, not AuthInfo
            f"AccountingStoragePass={self.munge_socket}\n"
            "JobAcctGatherType=jobacct_gather/linux\nReturnToService=2\nMinJobAge=300\n"
            "GresTypes=gpu\nAccountingStorageTRES=gres/gpu\n"
            f"NodeName={self.host} CPUs={os.cpu_count()} RealMemory={mem} Gres=gpu:1 State=UNKNOWN\n"
            f"PartitionName={PARTITION} Nodes={self.host} Default=YES MaxTime=INFINITE State=UP\n"
            f"PartitionName={GPU_PARTITION} Nodes={self.host} MaxTime=INFINITE State=UP\n")
        # Slurm drops a GPU without a device file ("Removing file-less GPU gpu:(null) from final GRES list"):
        # the node's GPU is a device file that is /dev/null (numbered as NVIDIA's, so Slurm indexes it 0)
        (r / "dev").mkdir(exist_ok=True)
        (r / "dev/nvidia0").unlink(missing_ok=True)
        (r / "dev/nvidia0").symlink_to("/dev/null")
        (r / "etc/gres.conf").write_text(f"NodeName={self.host} Name=gpu File={r}/dev/nvidia0\n")

    def _start_slurmdbd(self) -> None:
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        _wait(lambda: self.run("sacctmgr", "-n", "show", "cluster", check=False).returncode == 0,
              "slurmdbd", self.root / "log/slurmdbd.log")
        self.run("sacctmgr", "-i", "add", "cluster", "fedhisto")
        self.run("sacctmgr", "-i", "add", "account", ACCOUNT, "Cluster=fedhisto")
        self.run("sacctmgr", "-i", "add", "user", "root", f"Account={ACCOUNT}")

    def _node_idle(self) -> bool:
        proc = self.run("sinfo", "-h", "-o", "%T", check=False)  # one line per partition
        states = set(proc.stdout.split())
        return proc.returncode == 0 and bool(states) and states <= {"idle", "mixed"}
