"""The reference tests' bookkeeping: what each covers, and the largest difference each measured.

Each ``tests/test_reference_*.py`` declares what it covers in ``REFERENCES`` (:class:`Reference`); a test
measures its largest difference from the reference and hands it to :func:`check`, which asserts it
is within the test's tolerance and, when ``FEDHISTO_REFERENCE_RECORD`` names a file (the recording
command ``python benchmarks/reference_differences.py`` sets it), records it there. The meta-test
(``test_reference_coverage.py``) fails when a registered method or aggregator has no declaration.
Nothing here calls fedhisto (``reference_support`` does, and hands the tests :class:`Reference` and
:func:`check` with the rest, so a test imports from one place).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECORD_ENV = "FEDHISTO_REFERENCE_RECORD"
KINDS = ("method", "aggregator", "mechanism")


# ------------------------------------------------------------------ what each test covers
@dataclass(frozen=True)
class Reference:
    """One row of the methods guide's reference table: ``name`` (a registered method, a registered LoRA
    aggregator or a named mechanism) compared with ``reference`` in the test function ``test`` of the
    declaring module."""

    kind: str
    name: str
    reference: str
    test: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"reference kind {self.kind!r}: one of {KINDS}")


def reference_modules() -> list[Path]:
    return sorted((REPO / "tests").glob("test_reference_*.py"))


def declared(request: pytest.FixtureRequest, kind: str, name: str) -> Reference:
    """The declaration of (kind, name) by the requesting test in its module's ``REFERENCES``."""
    test = request.node.originalname
    found = [r for r in getattr(request.module, "REFERENCES", []) if (r.kind, r.name, r.test) == (kind, name, test)]
    if len(found) != 1:
        raise LookupError(f"{request.module.__name__}.REFERENCES declares {len(found)} references of {kind} {name!r} "
                          f"for {test} (exactly one is needed)")
    return found[0]


def check(request: pytest.FixtureRequest, kind: str, name: str, difference: float, tolerance: float) -> None:
    """Assert the largest difference ``difference`` of ``name`` from its reference is within ``tolerance``,
    recording it first (so a known defect's xfail records its difference too)."""
    ref = declared(request, kind, name)
    difference = float(difference)
    if not math.isfinite(difference):
        raise AssertionError(f"{kind} {name}: the difference from {ref.reference} is {difference}")
    marker = request.node.get_closest_marker("xfail")
    _record(ref, Path(request.module.__file__), difference, marker.kwargs.get("reason") if marker else None)
    assert difference <= tolerance, (f"{kind} {name} differs from {ref.reference} by {difference:.3e} "
                                     f"(tolerance {tolerance:.1e})")


def _record(ref: Reference, module: Path, difference: float, known_defect: str | None) -> None:
    """Largest difference per (kind, name, reference) into the file ``FEDHISTO_REFERENCE_RECORD`` names,
    under an exclusive lock (pytest-xdist workers record into one file)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    key = f"{ref.kind}:{ref.name}:{ref.reference}"
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        target = Path(path)
        data = json.loads(target.read_text()) if target.exists() else {}
        before = data.get(key, {}).get("max_difference", 0.0)
        data[key] = {"kind": ref.kind, "name": ref.name, "reference": ref.reference,
                     "test": f"tests/{module.name}::{ref.test}", "max_difference": max(before, difference),
                     "known_defect": known_defect}
        scratch = target.with_suffix(".tmp")
        scratch.write_text(json.dumps(data, indent=1, sort_keys=True))
        scratch.replace(target)
