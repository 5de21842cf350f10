"""Time the README's first command as a new user runs it, and record the figure the README shows.

Usage (on a quiet machine: the figure is only worth the host and how busy it was)::

    python benchmarks/first_command_timing.py [--keep DIR] [--record PATH]

Clones this checkout's HEAD into a fresh folder (uncommitted changes are not timed: the record names the
commit), and runs the README's first command there exactly as written (the first ```bash block), with an
empty pip cache (``PIP_CACHE_DIR`` in a new folder) and the environment of this shell otherwise (pip's own
configuration, e.g. the index that serves torch's CPU build, applies as it would to the user). Each ``&&``
step is timed with the shell's clock. The record, ``benchmarks/records/first_command_timing.json``, holds
the command, the commit, the time, the host (CPU model, the SIMD level the clone's torch dispatches to,
cache sizes), the number of cores, the load average before the run, and each step's wall seconds; then
``fedhisto records`` writes the README's ``first_command_timing`` block from it
(:func:`fedhisto.records.first_command.render`). Nothing is recorded if the command fails.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "benchmarks/records/first_command_timing.json"
MARK = "fedhisto-timing-step"


def first_command(readme: Path) -> str:
    """The README's first command: the body of its first ```bash block, on one line."""
    blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.S)
    if not blocks:
        raise SystemExit(f"{readme}: no ```bash block")
    return " ".join(blocks[0].split())


def timed_script(command: str) -> tuple[list[str], str]:
    """(the ``&&`` steps of ``command``, a bash script running them in one shell, as ``&&`` does, that
    prints a clock line to stderr after each)."""
    steps = [s.strip() for s in command.split(" && ")]
    lines = ["set -e", f'echo "{MARK} start $(date +%s.%N)" >&2']
    for i, step in enumerate(steps):
        lines += [step, f'echo "{MARK} {i} $(date +%s.%N)" >&2']
    return steps, "\n".join(lines) + "\n"


def run_timed(command: str, cwd: Path, env: dict[str, str], log: Path) -> list[dict]:
    """Run ``command``'s steps in ``cwd`` (output to ``log``); each step with its wall seconds."""
    steps, script = timed_script(command)
    with log.open("w") as out:
        proc = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    clock = {}
    for line in log.read_text().splitlines():
        if line.startswith(MARK + " "):
            _, key, stamp = line.split()
            clock[key] = float(stamp)
    if proc.returncode != 0 or len(clock) != len(steps) + 1:
        done = len(clock) - 1
        raise SystemExit(f"the command failed at step {done + 1} ({steps[min(done, len(steps) - 1)]!r}, exit "
                         f"{proc.returncode}); its output: {log}")
    marks = [clock["start"], *(clock[str(i)] for i in range(len(steps)))]
    return [{"command": s, "wall_s": round(b - a, 2)} for s, a, b in zip(steps, marks[:-1], marks[1:], strict=True)]


def host(clone: Path) -> dict:
    """CPU model, SIMD level (from the clone's own torch when it has a venv), cache sizes, cores."""
    from fedhisto.infra.provenance import cpu_caches

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").is_file() else "unknown CPU"
    simd = "unknown SIMD"
    python = clone / ".venv/bin/python"
    if python.is_file():
        proc = subprocess.run([str(python), "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                              capture_output=True, text=True)
        simd = proc.stdout.strip() or simd
    return {"host": f"{cpu} ({simd})", "cpu_caches": cpu_caches(), "cores": os.cpu_count()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="clone into this new folder and keep it (default: a temporary one)")
    parser.add_argument("--record", type=Path, default=RECORD, help=f"where to write the record (default: {RECORD})")
    args = parser.parse_args(argv)
    from fedhisto.infra.atomic import write_json

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()
    command = first_command(REPO / "README.md")
    scratch = Path(tempfile.mkdtemp(prefix="fedhisto-first-command-"))
    clone = args.keep or scratch / "fedhisto"
    if clone.exists():
        raise SystemExit(f"{clone} exists; give a new folder")
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "checkout", "--quiet", commit], cwd=clone, check=True)
    (scratch / "pip-cache").mkdir()
    env = {**os.environ, "PIP_CACHE_DIR": str(scratch / "pip-cache")}
    for name in ("VIRTUAL_ENV", "PYTHONPATH"):  # the user's fresh shell has neither
        env.pop(name, None)
    load = list(os.getloadavg())
    print(f"timing in {clone} (load average {load[0]:.2f}): {command}", flush=True)
    started = time.time()
    steps = run_timed(command, clone, env, scratch / "first_command.log")  # a failure keeps the folder and log
    record = {"about": "The README's first command, run as written in a fresh clone with an empty pip cache; "
                       "written by `python benchmarks/first_command_timing.py`",
              "command": command, "commit": commit,
              "made_utc": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
              **host(clone), "load_before": [round(x, 2) for x in load], "pip_cache": "empty",
              "steps": steps, "wall_s": round(sum(s["wall_s"] for s in steps), 2)}
    shutil.rmtree(scratch / "pip-cache")
    if args.keep is None:
        shutil.rmtree(scratch)
    write_json(args.record, record)
    print(f"{record['wall_s']:.0f} s in all, recorded in {args.record}; `fedhisto records` writes the README's figure")


if __name__ == "__main__":
    main()
