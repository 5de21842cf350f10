"""The methods guide's table of how far each method, LoRA aggregator and mechanism is from its independent
reference, rendered from the committed record ``benchmarks/records/reference_differences.json``.

The record is written by ``python benchmarks/reference_differences.py`` (it runs ``pytest -m reference``, whose
tests each measure their largest difference from code the project did not write or from a paper's equations
written in the test). Many methods share a reference check (every FedAvg-PEFT-objective method is checked
against the same equations); such entries, equal in reference, test and difference, share one row, so the
table lists each check once with every method it covers.
"""

from __future__ import annotations

KIND_ORDER = {"method": 0, "aggregator": 1, "mechanism": 2}


def _difference(entry: dict) -> str:
    d = entry["max_difference"]
    text = "0" if d == 0 else f"{d:.1e}"
    if entry.get("known_defect"):
        text += f" (known defect, expected to fail: {entry['known_defect']})"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bar inside a cell (a norm) would split it


def _names(kind: str, names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) + ("" if kind == "method" else f" ({kind})")


def render(record: dict) -> str:
    """The table (Markdown, without the block's delimiting lines) of a reference record: one row per
    (kind, reference, test, difference as printed), naming every method or aggregator that shares it."""
    groups: dict[tuple[str, str, str, str], list[str]] = {}
    for r in record["references"]:
        groups.setdefault((r["kind"], r["reference"], r["test"], _difference(r)), []).append(r["name"])
    rows = sorted(((kind, sorted(set(names)), ref, test, diff) for (kind, ref, test, diff), names in groups.items()),
                  key=lambda g: (KIND_ORDER[g[0]], g[1][0], g[3], g[2]))
    lines = ["| Method or aggregator | Reference | Max difference | Test |", "|---|---|---|---|"]
    lines += [f"| {_names(kind, names)} | {_cell(ref)} | {_cell(diff)} | `{test}` |"
              for kind, names, ref, test, diff in rows]
    return "\n".join(lines) + "\n"
