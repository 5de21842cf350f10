"""The README's figure of how long its first command takes, rendered from the committed timing record
``benchmarks/records/first_command_timing.json``.

The record is written by ``python benchmarks/first_command_timing.py``, which runs the README's first command
as written in a fresh clone with an empty pip cache and times each of its ``&&`` steps. A speed figure is
only worth its host and how busy that host was, so the block states both (the record's stamp names the
CPU and SIMD level, the body the cores and the load average before the run).
"""

from __future__ import annotations


def duration(seconds: float) -> str:
    """``6 min 5 s`` (or ``48 s`` under a minute), rounded to the second."""
    s = round(seconds)
    return f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"


def render(record: dict) -> str:
    """One paragraph: the whole command's wall time, its install and pipeline parts, on how many cores and
    at which load."""
    steps = record["steps"]
    if not steps:
        raise ValueError("the timing record has no steps")
    pipeline = [s for s in steps if s["command"].startswith("snakemake")]
    install = sum(s["wall_s"] for s in steps if s not in pipeline)
    parts = [f"{duration(install)} to create the environment and install"] + [
        f"{duration(s['wall_s'])} for `{s['command']}`" for s in pipeline]
    load = record.get("load_before")
    busy = f", load average {load[0]:.2f} when it started" if load else ""
    return (f"The first command above took **{duration(record['wall_s'])}** in a fresh clone with an empty pip "
            f"cache, on {record['cores']} cores{busy}: {'; '.join(parts)}.\n")
