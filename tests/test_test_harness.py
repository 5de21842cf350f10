"""The suite's own harness: what one test changes in its process does not reach the tests after it."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

# torch's intra-op thread count as the process started it (OMP_NUM_THREADS, else one per core)
STARTED_WITH = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS") else torch.get_num_threads()


def test_a_stage_run_in_process_sets_torchs_threads():
    """As `fedhisto classify` (--threads 2) or a stage's run_* with threads=2 does in the test process."""
    torch.set_num_threads(STARTED_WITH + 2)
    assert torch.get_num_threads() == STARTED_WITH + 2


def test_the_next_test_runs_on_the_threads_the_process_started_with():
    """Left at the earlier test's count, every later torch test of the worker ran 2+ OpenMP threads that
    spin-wait for each other while other processes hold the cores: eight bf16 rounds of
    tests/test_gpu_path.py took 206 s of CPU after torch.set_num_threads(2) and 16 s at one thread (one
    run each on a 2-core host at load 15-20)."""
    assert torch.get_num_threads() == STARTED_WITH


def test_markers_are_applied_by_name_in_the_test_files():
    """conftest.pytest_ignore_collect skips, under `pytest -m <lane>`, every file that does not name
    `mark.<lane>`: a marker added another way (a hook, add_marker, getattr) would be skipped unseen."""
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    for path in tests.glob("*.py"):
        text = path.read_text()
        for dynamic in ("add_marker(", "applymarker(", "getattr(pytest.mark", "pytest_collection_modifyitems"):
            assert dynamic not in text or path.name == "test_test_harness.py", f"{path.name} uses {dynamic}"


def test_each_lane_collects_every_test_its_marker_names(pytestconfig):
    """The lane markers' files, by the same text test as conftest's hook, hold at least the proofs'
    known files (a renamed marker or file would otherwise empty a lane without a word)."""
    from pathlib import Path

    from conftest import LANE_MARKERS

    tests = Path(__file__).resolve().parent
    named = {m: {p.name for p in tests.glob("test_*.py") if f"mark.{m}" in p.read_text()} for m in LANE_MARKERS}
    assert {"test_slurm.py"} <= named["slurm"] and {"test_study_rehearsal.py"} <= named["study"]
    assert {"test_flower.py", "test_fastpath.py"} <= named["flower"] and {"test_zoo.py"} <= named["zoo"]
    declared = {m.split(":")[0] for m in pytestconfig.getini("markers")}
    assert set(LANE_MARKERS) <= declared
