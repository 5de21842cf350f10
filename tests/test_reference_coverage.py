"""Every registered method and LoRA aggregator has a reference test, and the methods guide's table of
reference differences is the committed record's.

The reference tests declare what they cover (``REFERENCES`` in each ``tests/test_reference_*.py``); a
method or aggregator registered without one fails here. The record
(``benchmarks/records/reference_differences.json``) is written by ``python
benchmarks/reference_differences.py``, which runs ``pytest -m reference`` with recording on; while it
records, the record is being rewritten, so the checks against it wait for the next run.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re

import pytest
from reference_record import KINDS, RECORD_ENV, REPO, Reference, reference_modules
from reference_support import registered_aggregators, registered_methods

pytestmark = pytest.mark.reference

RECORD = REPO / "benchmarks/records/reference_differences.json"
GUIDE = REPO / "docs/methods.md"
MECHANISMS = {"dp_sgd", "rdp_accountant", "metrics", "bootstrap"}
recording = pytest.mark.skipif(bool(os.environ.get(RECORD_ENV)), reason="the record is being rewritten by this run")


def declarations() -> list[tuple[str, Reference]]:
    """(module name, declaration) of every reference test module."""
    out = []
    for path in reference_modules():
        module = importlib.import_module(path.stem)
        out += [(path.stem, r) for r in getattr(module, "REFERENCES", [])]
    return out


def renderer():
    spec = importlib.util.spec_from_file_location("reference_differences", REPO / "benchmarks/reference_differences.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unreferenced(declared: list[tuple[str, Reference]]) -> list[str]:
    """Every registered method and LoRA aggregator no declaration covers, as 'kind name'."""
    covered = {kind: {r.name for _, r in declared if r.kind == kind} for kind in KINDS}
    return ([f"method {m}" for m in registered_methods() if m not in covered["method"]]
            + [f"aggregator {a}" for a in registered_aggregators() if a not in covered["aggregator"]])


def test_every_registered_method_and_aggregator_has_a_reference_test():
    declared = declarations()
    covered = {kind: {r.name for _, r in declared if r.kind == kind} for kind in KINDS}
    missing = unreferenced(declared)
    assert not missing, f"registered without a reference test (declare one in a REFERENCES list): {missing}"
    assert covered["method"] <= set(registered_methods()), sorted(covered["method"] - set(registered_methods()))
    assert covered["aggregator"] <= set(registered_aggregators())
    assert covered["mechanism"] == MECHANISMS
    for module_name, ref in declared:
        module = importlib.import_module(module_name)
        test = getattr(module, ref.test, None)
        assert callable(test) and ref.test.startswith("test_"), f"{module_name}: no test {ref.test} for {ref}"
        marks = [m.name for m in getattr(module, "pytestmark", [])] if isinstance(
            getattr(module, "pytestmark", None), list) else [module.pytestmark.name]
        assert "reference" in marks, f"{module_name} is not marked pytest.mark.reference"
    keys = [(r.kind, r.name, r.reference) for _, r in declared]
    assert len(keys) == len(set(keys)), "a (kind, name, reference) is declared twice"


def test_a_method_registered_without_a_reference_test_is_named():
    from fedhisto.methods import register, unregister

    register("unreferenced_probe", "fedhisto.methods.local_only:LocalOnly")
    try:
        assert unreferenced(declarations()) == ["method unreferenced_probe"]
    finally:
        unregister("unreferenced_probe")


@recording
def test_the_record_holds_every_declared_reference_and_nothing_else():
    record = json.loads(RECORD.read_text())
    recorded = {(r["kind"], r["name"], r["reference"], r["test"]) for r in record["references"]}
    declared = {(r.kind, r.name, r.reference, f"tests/{m}.py::{r.test}") for m, r in declarations()}
    assert recorded == declared, ("benchmarks/records/reference_differences.json is stale; run "
                                  "`python benchmarks/reference_differences.py`: "
                                  f"unrecorded {sorted(declared - recorded)[:3]}, gone {sorted(recorded - declared)[:3]}")


@recording
def test_the_methods_guide_table_is_the_records():
    """The guide's block is `fedhisto records`' rendering of the committed record (the same renderer the
    benchmark script re-exports), and it names every registered method and aggregator."""
    from fedhisto.records.record_blocks import render_block

    module = renderer()
    record = json.loads(RECORD.read_text())
    table = module.render(record)
    shown = module.block(GUIDE.read_text(), module.BLOCK)
    assert shown == render_block(module.BLOCK, REPO) and shown.endswith(table), (
        "docs/methods.md's reference table differs from the record: run `fedhisto records` "
        "(or `python benchmarks/reference_differences.py --render-only`)")
    named = {kind: set() for kind in ("method", "aggregator")}
    for first in re.findall(r"^\| (.+?) \| ", table, flags=re.M)[1:]:
        kind = re.search(r" \((aggregator|mechanism)\)$", first)
        named.setdefault(kind.group(1) if kind else "method", set()).update(re.findall(r"`([^`]+)`", first))
    assert set(registered_methods()) <= named["method"], set(registered_methods()) - named["method"]
    assert set(registered_aggregators()) <= named["aggregator"], set(registered_aggregators()) - named["aggregator"]


def test_the_renderer_states_known_defects_and_exact_zeros():
    module = renderer()
    entry = {"kind": "method", "name": "m", "reference": "r", "test": "tests/t.py::test_x"}
    table = module.render({"references": [{**entry, "max_difference": 0.0, "known_defect": None},
                                          {**entry, "kind": "aggregator", "max_difference": 0.1234,
                                           "known_defect": "a bug"}]})
    assert table.splitlines()[2:] == [
        "| `m` | r | 0 | `tests/t.py::test_x` |",
        "| `m` (aggregator) | r | 1.2e-01 (known defect, expected to fail: a bug) | `tests/t.py::test_x` |"]
    shared = module.render({"references": [{**entry, "name": n, "max_difference": 0.5, "known_defect": None}
                                            for n in ("b", "a")]})
    assert shared.splitlines()[2:] == ["| `a`, `b` | r | 5.0e-01 | `tests/t.py::test_x` |"]  # one row, both names
    bars = module.render({"references": [{**entry, "reference": "(mu/2) ||w||^2", "max_difference": 1.0,
                                          "known_defect": None}]})
    assert "| (mu/2) \\|\\|w\\|\\|^2 |" in bars  # a norm's bars would split the cell
    text = "a\n<!-- generated:x begin -->\nold\n<!-- generated:x end -->\nb\n"
    assert module.replace_block(text, "x", "new\n") == "a\n<!-- generated:x begin -->\nnew\n<!-- generated:x end -->\nb\n"
    with pytest.raises(ValueError, match="no block generated:y"):
        module.replace_block(text, "y", "")
