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
