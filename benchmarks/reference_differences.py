"""Record how far every method, LoRA aggregator and mechanism is from its independent reference, and
render the methods guide's table of it.

Usage::

    python benchmarks/reference_differences.py                 # run `pytest -m reference`, record, render
    python benchmarks/reference_differences.py --render-only   # re-render the table from the committed record

The reference tests (``tests/test_reference_*.py``) each measure their largest difference from code the
project did not write (Flower, peft, Opacus, scikit-learn) or from a paper's equations written in the
test; with ``FEDHISTO_REFERENCE_RECORD`` naming a file they record it there. This script runs them with
that variable set (refusing to record unless they pass; a known defect's strict xfail counts as passing
and is recorded with its reason), writes the record to ``benchmarks/records/reference_differences.json``
and the table between the ``generated:reference_differences`` lines of ``docs/methods.md``.
:func:`render` is the table as a plain function of the record.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "benchmarks/records/reference_differences.json"
GUIDE = REPO / "docs/methods.md"
BLOCK = "reference_differences"
KIND_ORDER = {"method": 0, "aggregator": 1, "mechanism": 2}
LIBRARIES = ("torch", "numpy", "scipy", "scikit-learn", "flwr", "peft", "opacus")


def _rows(record: dict) -> list[dict]:
    return sorted(record["references"], key=lambda r: (KIND_ORDER[r["kind"]], r["name"], r["test"], r["reference"]))


def _difference(entry: dict) -> str:
    d = entry["max_difference"]
    text = "0" if d == 0 else f"{d:.1e}"
    if entry.get("known_defect"):
        text += f" (known defect, expected to fail: {entry['known_defect']})"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bar inside a cell (a norm) would split it


def render(record: dict) -> str:
    """The methods guide's table (Markdown, without the delimiting lines) of a reference record."""
    lines = ["| Method or aggregator | Reference | Max difference | Test |", "|---|---|---|---|"]
    for r in _rows(record):
        name = f"`{r['name']}`" if r["kind"] == "method" else f"`{r['name']}` ({r['kind']})"
        lines.append(f"| {name} | {_cell(r['reference'])} | {_cell(_difference(r))} | `{r['test']}` |")
    return "\n".join(lines) + "\n"


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
            "recorded_with": _versions(),
            "references": sorted(entries, key=lambda r: (KIND_ORDER[r["kind"]], r["name"], r["test"], r["reference"]))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--render-only", action="store_true",
                        help="re-render the guide's table from the committed record, running no test")
    args = parser.parse_args(argv)
    from fedhisto.infra.atomic import write_json, write_text

    if args.render_only:
        record = json.loads(RECORD.read_text())
    else:
        record = record_references()
        write_json(RECORD, record)
    write_text(GUIDE, replace_block(GUIDE.read_text(), BLOCK, render(record)))
    print(f"{len(record['references'])} references; table written to {GUIDE.relative_to(REPO)}")


if __name__ == "__main__":
    main()
