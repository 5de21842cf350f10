"""Where a pipeline run's wall time went: a per-job timeline from Snakemake's log, the job logs and the warm
server's log, with CPU seconds per stage, idle cores, serial stretches and the critical path.

Run it in the working directory of a finished ``snakemake`` run (it reads the newest
``.snakemake/log/*.snakemake.log``, ``logs/<stage>/...log`` and ``logs/warm_server.log``):

    python benchmarks/pipeline_timeline.py [--log .snakemake/log/X.snakemake.log] [--time time.txt]
        [--cores 2] [--jobs] [--json timeline.json]

- ``--time``: the output of ``/usr/bin/time -v snakemake ...`` (or ``-f '%e %U %S'``): the whole command's
  wall and CPU seconds, so that Snakemake's start-up and its own scheduling show beside the jobs'.
- per rule: jobs, wall seconds from Snakemake's start to its finish line, seconds from the job log's first to
  last line, and CPU seconds where the warm server measured them (the job process up to its call, plus the
  forked child: ``wait4``'s user + system time, which includes the child's own pool workers);
- cores: idle core-seconds (cores x span minus the threads jobs held), seconds with each number of jobs
  running, and the stretches where fewer jobs ran than there were cores;
- the critical path: the longest chain of jobs through their input/output files, each job at its wall time.

Snakemake stamps its lines to the second, so per-job walls are +/- 1 s; the job logs and the warm server's
are to the millisecond. Nothing here judges: it prints figures for comparing two runs on the same host.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
RULE = re.compile(r"^(?:local)?rule (\S+):$")
FINISHED = re.compile(r"^Finished jobid: (\d+)|^Finished job (\d+)\.")
LOG_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
WARM_START = re.compile(r"^(\S+ \S+) \S+ INFO warm server: (\S+) for pid \d+ in child (\d+) \(log (.*), job process "
                        r"([0-9.]+|nan) s CPU before the call\)$")
WARM_END = re.compile(r"^(\S+ \S+) \S+ INFO warm server: child (\d+) ended \(([^)]*)\), peak resident memory ([0-9.]+) "
                      r"GiB, CPU ([0-9.]+) s user ([0-9.]+) s system$")


@dataclass
class Job:
    jobid: int
    rule: str
    start: float                      # seconds since the first job started (Snakemake's stamps)
    end: float | None = None
    threads: int = 1
    wildcards: str = ""
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    log: str = ""
    logged_s: float | None = None     # first to last line of the job's log
    process_cpu_s: float | None = None  # the job process up to its warm call (interpreter, preamble, config)
    child_cpu_s: float | None = None    # the warm child, with its reaped descendants
    peak_gib: float | None = None

    @property
    def wall(self) -> float:
        return (self.end if self.end is not None else self.start) - self.start

    @property
    def cpu_s(self) -> float | None:
        if self.child_cpu_s is None:
            return None
        return self.child_cpu_s + (self.process_cpu_s or 0.0)


def _when(text: str) -> datetime:
    return datetime.strptime(" ".join(text.split()), "%a %b %d %H:%M:%S %Y")


def _log_when(line: str) -> datetime | None:
    m = LOG_STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(microsecond=int(m.group(2)) * 1000) if m else None


def parse_snakemake_log(text: str) -> tuple[list[Job], datetime | None]:
    """Jobs with start and finish from a Snakemake log; also the stamp of its first job (time zero)."""
    lines = text.splitlines()
    jobs: dict[int, Job] = {}
    zero: datetime | None = None
    now: datetime | None = None
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        stamp = STAMP.match(line)
        if stamp:
            now = _when(stamp.group(1))
            i += 1
            continue
        rule, done = RULE.match(line), FINISHED.match(line)
        if rule and now is not None:
            zero = zero or now
            fields: dict[str, str] = {}
            i += 1
            while i < len(lines) and lines[i].startswith("    "):
                key, _, value = lines[i].strip().partition(": ")
                fields[key] = value
                i += 1
            if "jobid" not in fields:
                continue
            job = Job(int(fields["jobid"]), rule.group(1), (now - zero).total_seconds(),
                      threads=int(fields.get("threads", 1)), wildcards=fields.get("wildcards", ""),
                      inputs=_files(fields.get("input", "")), outputs=_files(fields.get("output", "")),
                      log=fields.get("log", "").split(", ")[0])
            jobs[job.jobid] = job
            continue
        if done and now is not None and zero is not None:
            jobid = int(done.group(1) or done.group(2))
            if jobid in jobs:
                jobs[jobid].end = (now - zero).total_seconds()
        i += 1
    return sorted(jobs.values(), key=lambda j: (j.start, j.jobid)), zero


def _files(value: str) -> list[str]:
    return [f.strip() for f in value.split(", ") if f.strip()]


def add_job_logs(jobs: list[Job], workdir: Path) -> None:
    for job in jobs:
        path = workdir / job.log if job.log else None
        if path is None or not path.is_file():
            continue
        stamps = [t for t in map(_log_when, path.read_text(errors="replace").splitlines()) if t is not None]
        if stamps:
            job.logged_s = (max(stamps) - min(stamps)).total_seconds()


def add_warm_cpu(jobs: list[Job], warm_log: Path) -> None:
    """CPU seconds of each warm job: its process up to the call, and its forked child (matched by log path)."""
    if not warm_log.is_file():
        return
    by_log = {j.log: j for j in jobs if j.log}
    child_job: dict[str, Job] = {}
    for line in warm_log.read_text(errors="replace").splitlines():
        start, end = WARM_START.match(line), WARM_END.match(line)
        if start and start.group(4) in by_log:
            job = by_log[start.group(4)]
            child_job[start.group(3)] = job
            job.process_cpu_s = None if start.group(5) == "nan" else float(start.group(5))
        elif end and end.group(2) in child_job:
            job = child_job.pop(end.group(2))
            job.child_cpu_s = float(end.group(5)) + float(end.group(6))
            job.peak_gib = float(end.group(4))


def critical_path(jobs: list[Job]) -> list[Job]:
    """The chain of jobs, each needing a file of the one before, whose walls add up to the most."""
    maker = {out: j for j in jobs for out in j.outputs}
    best: dict[int, tuple[float, list[Job]]] = {}

    def longest(job: Job) -> tuple[float, list[Job]]:
        if job.jobid not in best:
            parents = {maker[f].jobid: maker[f] for f in job.inputs if f in maker and maker[f] is not job}
            tails = [longest(p) for p in parents.values()]
            length, chain = max(tails, key=lambda t: t[0], default=(0.0, []))
            best[job.jobid] = (length + job.wall, [*chain, job])
        return best[job.jobid]

    sys.setrecursionlimit(max(1000, 4 * len(jobs)))
    return max((longest(j) for j in jobs), key=lambda t: t[0], default=(0.0, []))[1]


def concurrency(jobs: list[Job], cores: int) -> dict:
    """Per second of the span: how many jobs ran and how many cores their threads held."""
    span = max((j.end or j.start for j in jobs), default=0.0)
    seconds = round(span)
    running, held = [0] * seconds, [0] * seconds
    for j in jobs:  # a job without a finish line (failed, or still running) counts to the span's end
        for t in range(int(j.start), int(j.end if j.end is not None else span)):
            if t < seconds:
                running[t] += 1
                held[t] += min(j.threads, cores)
    by_count: dict[int, int] = defaultdict(int)
    for r in running:
        by_count[r] += 1
    stretches, begin = [], None
    for t, h in enumerate([*held, cores]):
        if h < cores and begin is None:
            begin = t
        elif h >= cores and begin is not None:
            if t - begin >= 3:  # shorter gaps are the stamps' rounding
                rules = sorted({j.rule for j in jobs if (j.end or j.start) > begin and j.start < t})
                stretches.append({"from_s": begin, "to_s": t, "idle_cores": cores - min(held[begin:t]), "running": rules})
            begin = None
    return {"span_s": span, "idle_core_s": sum(cores - min(h, cores) for h in held), "seconds_by_running_jobs":
            dict(sorted(by_count.items())), "under_used": stretches}


def per_rule(jobs: list[Job]) -> list[dict]:
    rows: dict[str, dict] = {}
    for j in jobs:
        r = rows.setdefault(j.rule, {"rule": j.rule, "jobs": 0, "wall_s": 0.0, "logged_s": 0.0, "cpu_s": 0.0,
                                     "cpu_jobs": 0, "process_cpu_s": 0.0, "first_start_s": j.start, "last_end_s": 0.0})
        r["jobs"] += 1
        r["wall_s"] += j.wall
        r["logged_s"] += j.logged_s or 0.0
        r["last_end_s"] = max(r["last_end_s"], j.end or j.start)
        if j.cpu_s is not None:
            r["cpu_s"] += j.cpu_s
            r["process_cpu_s"] += j.process_cpu_s or 0.0
            r["cpu_jobs"] += 1
    return sorted(rows.values(), key=lambda r: r["first_start_s"])


def read_time_file(path: Path) -> dict:
    """Wall, user and system seconds of the whole command from GNU time's -v output (or '%e %U %S')."""
    text = path.read_text(errors="replace")
    out = {}
    for key, pattern in (("user_s", r"User time \(seconds\): ([0-9.]+)"), ("sys_s", r"System time \(seconds\): ([0-9.]+)"),
                         ("wall", r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([0-9:.]+)")):
        m = re.search(pattern, text)
        if m:
            out[key] = m.group(1)
    if "wall" in out:
        parts = [float(p) for p in out.pop("wall").split(":")]
        out["wall_s"] = sum(p * 60 ** k for k, p in enumerate(reversed(parts)))
        out = {k: float(v) for k, v in out.items()}
    else:
        m = re.search(r"^([0-9.]+) ([0-9.]+) ([0-9.]+)$", text, re.M)
        if m:
            out = {"wall_s": float(m.group(1)), "user_s": float(m.group(2)), "sys_s": float(m.group(3))}
    return out


def build(workdir: Path, log: Path | None, cores: int, time_file: Path | None) -> dict:
    if log is None:
        logs = sorted((workdir / ".snakemake/log").glob("*.snakemake.log"))
        if not logs:
            raise SystemExit(f"no Snakemake log under {workdir / '.snakemake/log'}: run the pipeline first, or give --log")
        log = logs[-1]
    jobs, zero = parse_snakemake_log(log.read_text(errors="replace"))
    if not jobs:
        raise SystemExit(f"{log}: no job in this Snakemake log (a dry run, or nothing to do)")
    add_job_logs(jobs, workdir)
    add_warm_cpu(jobs, workdir / "logs/warm_server.log")
    real = [j for j in jobs if j.rule != "all"]  # `all` is a target, not work
    doc = {"snakemake_log": str(log), "cores": cores, "jobs": len(real), "rules": per_rule(real),
           "cores_use": concurrency(real, cores), "critical_path": [
               {"rule": j.rule, "wildcards": j.wildcards, "start_s": j.start, "wall_s": j.wall} for j in critical_path(real)],
           "timeline": [{k: v for k, v in asdict(j).items() if k not in ("inputs", "outputs")} for j in real]}
    first_line = re.search(r"Date: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", log.read_text(errors="replace"))
    if first_line and zero is not None:  # Snakemake's log opens once the DAG is built
        doc["log_open_to_first_job_s"] = (zero - datetime.strptime(first_line.group(1), "%Y-%m-%d %H:%M:%S")).total_seconds()
    if time_file is not None:
        doc["command"] = read_time_file(time_file)
    return doc


def render(doc: dict, show_jobs: bool) -> str:
    use = doc["cores_use"]
    out = [f"{doc['jobs']} jobs in {use['span_s']:.0f} s from the first job's start to the last one's finish "
           f"({doc['snakemake_log']})"]
    if "log_open_to_first_job_s" in doc:
        out.append(f"Snakemake log opened to the first job: {doc['log_open_to_first_job_s']:.0f} s")
    if "command" in doc and "wall_s" in doc["command"]:
        c = doc["command"]
        out.append(f"whole command: {c['wall_s']:.1f} s wall, {c.get('user_s', 0) + c.get('sys_s', 0):.1f} s CPU "
                   f"(user {c.get('user_s', 0):.1f}, system {c.get('sys_s', 0):.1f}); outside the jobs' span: "
                   f"{c['wall_s'] - use['span_s']:.0f} s (start-up, DAG, shutdown)")
    out += ["", f"{'rule':<34}{'jobs':>5}{'wall s':>9}{'logged s':>10}{'CPU s':>9}{'of which job process':>22}"
                f"{'first start':>13}{'last end':>10}"]
    cpu_total = 0.0
    for r in doc["rules"]:
        cpu = f"{r['cpu_s']:.1f}" if r["cpu_jobs"] else "-"
        proc = f"{r['process_cpu_s']:.1f}" if r["cpu_jobs"] else "-"
        cpu_total += r["cpu_s"]
        out.append(f"{r['rule']:<34}{r['jobs']:>5}{r['wall_s']:>9.0f}{r['logged_s']:>10.1f}{cpu:>9}{proc:>22}"
                   f"{r['first_start_s']:>13.0f}{r['last_end_s']:>10.0f}")
    out.append(f"{'(warm jobs, measured CPU)':<34}{'':>5}{'':>9}{'':>10}{cpu_total:>9.1f}")
    out += ["", f"cores: {doc['cores']}; idle core-seconds inside the span: {use['idle_core_s']} "
                f"({use['idle_core_s'] / max(doc['cores'] * use['span_s'], 1):.0%}); seconds with N jobs running: "
                + ", ".join(f"{n}: {s}" for n, s in use["seconds_by_running_jobs"].items())]
    for s in use["under_used"]:
        out.append(f"  {s['from_s']:>5}-{s['to_s']:<5} s: {s['idle_cores']} core(s) idle at worst; running "
                   f"{', '.join(s['running']) or 'nothing'}")
    path = doc["critical_path"]
    out += ["", f"critical path: {len(path)} jobs, {sum(p['wall_s'] for p in path):.0f} s of wall"]
    for p in path:
        out.append(f"  {p['start_s']:>5.0f} s  {p['wall_s']:>4.0f} s  {p['rule']} {p['wildcards']}")
    if show_jobs:
        out += ["", f"{'start':>6}{'end':>6}{'wall':>6}{'logged':>8}{'CPU':>7}  rule wildcards"]
        for j in doc["timeline"]:
            cpu = "" if j["child_cpu_s"] is None else f"{j['child_cpu_s'] + (j['process_cpu_s'] or 0):.1f}"
            logged = "" if j["logged_s"] is None else f"{j['logged_s']:.1f}"
            end = j["end"] if j["end"] is not None else j["start"]
            out.append(f"{j['start']:>6.0f}{end:>6.0f}{end - j['start']:>6.0f}{logged:>8}{cpu:>7}  {j['rule']} "
                       f"{j['wildcards']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("."), help="the run's working directory (default: .)")
    ap.add_argument("--log", type=Path, default=None, help="a Snakemake log (default: the newest under .snakemake/log)")
    ap.add_argument("--cores", type=int, default=2, help="the run's --cores (default: 2)")
    ap.add_argument("--time", type=Path, default=None, help="GNU time's output for the whole command")
    ap.add_argument("--jobs", action="store_true", help="also print every job's line")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    doc = build(args.workdir, args.log, args.cores, args.time)
    print(render(doc, args.jobs))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
