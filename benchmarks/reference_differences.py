"""Record how far every method, LoRA aggregator and mechanism is from its independent reference, and write
the methods guide's table of it.

Usage::

    python benchmarks/reference_differences.py                 # run `pytest -m reference`, record, render
    python benchmarks/reference_differences.py --render-only   # re-render the table from the committed record

The reference tests (``tests/test_reference_*.py``) each measure their largest difference from code the
project did not write (Flower, peft, Opacus, scikit-learn) or from a paper's equations written in the
test; with ``FEDHISTO_REFERENCE_RECORD`` naming a file they record it there. This script runs them with
that variable set (refusing to record unless they pass; a known defect's strict xfail counts as passing
and is recorded with its reason), writes the record, stamped with the commit, day and host, to
``benchmarks/records/reference_differences.json``, and writes the ``reference_differences`` block of the
guides as ``fedhisto records`` does (the block is registered in ``fedhisto.registries.record_registry``;
its renderer is :func:`fedhisto.records.reference_table.render`, re-exported here as :func:`render`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from fedhisto.records.reference_table import KIND_ORDER, render  # noqa: F401  (the table, as a plain function)

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "benchmarks/records/reference_differences.json"
GUIDE = REPO / "docs/methods.md"
BLOCK = "reference_differences"
LIBRARIES = ("torch", "numpy", "scipy", "scikit-learn", "flwr", "peft", "opacus")


def replace_block(text: str, name: str, markdown: str) -> str:
    """``text`` with the lines between ``<!-- generated:NAME begin -->`` and ``... end -->`` replaced."""
    begin, end = f"<!-- generated:{name} begin -->\n", f"<!-- generated:{name} end -->"
    head, found, rest = text.partition(begin)
    if not found or end not in rest:
        raise ValueError(f"no block generated:{name} (a '{begin.strip()}' line and a '{end}' line) in the guide")
    return head + begin + markdown + end + rest.split(end, 1)[1]


def block(text: str, name: str) -> str:
    """The lines between the delimiters of the generated block ``name`` of ``text``."""
    begin, end = f"<!-- generated:{name} begin -->\n", f"<!-- generated:{name} end -->"
    return text.split(begin, 1)[1].split(end, 1)[0]


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"python": sys.version.split()[0], **{lib: version(lib) for lib in LIBRARIES}}


def _stamp() -> dict[str, str]:
    """The commit (``+dirty`` with uncommitted changes), the time and the host (CPU model, SIMD level)."""
    import torch

    from fedhisto.infra.provenance import runtime_block

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    cpu = runtime_block().get("cpu") or platform.machine()
    return {"commit": commit, "made_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": f"{cpu} ({torch.backends.cpu.get_cpu_capability()})"}


def record_references() -> dict:
    """Run ``pytest -m reference`` with recording on; the record, or SystemExit when a test failed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "record.json"
        env = {**os.environ, "FEDHISTO_REFERENCE_RECORD": str(path)}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "reference", "-q", "-p", "no:cacheprovider"],
                              cwd=REPO, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"pytest -m reference failed (exit {proc.returncode}): nothing recorded")
        entries = list(json.loads(path.read_text()).values()) if path.exists() else []
    if not entries:
        raise SystemExit("the reference tests recorded nothing")
    return {"about": "Largest difference of each method, LoRA aggregator and mechanism from its independent "
                     "reference, measured by tests/test_reference_*.py; written by "
                     "`python benchmarks/reference_differences.py`",
            **_stamp(), "recorded_with": _versions(),
            "references": sorted(entries, key=lambda r: (KIND_ORDER[r["kind"]], r["name"], r["test"], r["reference"]))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--render-only", action="store_true",
                        help="re-render the guide's table from the committed record, running no test")
    args = parser.parse_args(argv)
    from fedhisto.infra.atomic import write_json
    from fedhisto.records.record_blocks import write_guides

    if args.render_only:
        record = json.loads(RECORD.read_text())
    else:
        record = record_references()
        write_json(RECORD, record)
    written = write_guides(REPO, only={BLOCK})
    print(f"{len(record['references'])} references; block {BLOCK} written to "
          f"{', '.join(str(p.relative_to(REPO)) for p in written) or 'no guide (already up to date)'}")


if __name__ == "__main__":
    main()
