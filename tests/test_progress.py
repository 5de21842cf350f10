"""Progress bars only on a terminal; one log line per finished step everywhere (issue 22, item 3)."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_image

from fedhisto.infra import progress
from fedhisto.infra.progress import Progress, progress_iter


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _bars_back_on(monkeypatch):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)  # restored after the test
    yield
    progress.enable_bars()


def test_off_a_terminal_no_bar_is_drawn_and_the_step_logs_one_line(capsys, caplog):
    caplog.set_level(logging.INFO, logger="fedhisto")
    items = list(progress_iter(range(7), desc="render", unit="img"))
    assert items == list(range(7))
    assert capsys.readouterr().err == ""  # pytest's captured stderr is not a terminal
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("render: 7/7 img in ")


def test_on_a_terminal_the_bar_is_drawn_and_the_line_still_logged(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="fedhisto")
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with Progress(total=4, desc="verify", unit="pair") as bar:
        bar.update(3)
        bar.set_postfix(best="0.9")
    assert "verify" in term.getvalue() and "\r" in term.getvalue()
    msg = caplog.records[-1].getMessage()
    assert msg.startswith("verify: 3/4 pair in ") and msg.endswith(", best 0.9 (stopped early)")


def test_a_snakemake_job_draws_no_bar_even_on_a_terminal(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="fedhisto")
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    progress.disable_bars()
    list(progress_iter([1, 2], desc="plant", unit="img"))
    assert term.getvalue() == ""
    assert caplog.records[-1].getMessage().startswith("plant: 2/2 img")


def test_summary_off_logs_nothing_for_loops_that_log_each_iteration(caplog):
    caplog.set_level(logging.INFO, logger="fedhisto")
    with Progress(total=3, desc="rounds", unit="round", initial=1, summary=False) as bar:
        bar.update()
    assert caplog.records == []


def test_a_piped_stage_logs_step_lines_and_no_carriage_return_fragments(tmp_path: Path, repo: Path):
    """A real stage in a subprocess whose stderr is a pipe (as under Snakemake or CI)."""
    folder = tmp_path / "images"
    for k in range(6):
        write_image(folder / f"img{k}.png", seed=k, size=64)
    # bytes, not text: text mode would turn carriage returns into newlines and hide them
    proc = subprocess.run([sys.executable, "-m", "fedhisto.cli", "audit", str(folder), "--out", str(tmp_path / "out")],
                          capture_output=True, timeout=300, cwd=repo)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert b"\r" not in proc.stderr and b"\r" not in proc.stdout
    lines = err.splitlines()
    assert any(" fingerprint: 6/6 image in " in ln for ln in lines), err[-3000:]
    assert any(" verify: " in ln and " pair in " in ln for ln in lines), err[-3000:]
