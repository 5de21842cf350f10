"""benchmarks/predictions_digest.sh: equal prediction files give equal digests, one changed byte another."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _digest(results: Path) -> tuple[str, str]:
    out = subprocess.run(["bash", str(REPO / "benchmarks/predictions_digest.sh"), str(results)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return out[-2], out[-1]


def _run(root: Path, external: str) -> Path:
    for method, body in (("past_v2", external), ("fedavg_peft", "sample_id,label\nb,1\n")):
        folder = root / "results" / "predictions" / method / "seed11"
        folder.mkdir(parents=True)
        (folder / "external.csv").write_text(body)
    return root / "results"


def test_equal_files_equal_digest_and_one_byte_differs(tmp_path: Path) -> None:
    a = _digest(_run(tmp_path / "a", "sample_id,label\na,0\n"))
    assert a == _digest(_run(tmp_path / "b", "sample_id,label\na,0\n"))
    assert a[0] == "files: 2"
    assert a[1] != _digest(_run(tmp_path / "c", "sample_id,label\na,1\n"))[1]
    missing = subprocess.run(["bash", str(REPO / "benchmarks/predictions_digest.sh"), str(tmp_path / "none")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "no " in missing.stderr
