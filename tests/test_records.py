"""`fedhisto records`: the guides' result blocks are what the committed records render, a block says when the
code of the stages that made it has changed since, and the renderers print what the result files hold."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fedhisto.records import record_blocks
from fedhisto.records.code_digest import Commit, Tree, stage_digest, stage_files
from fedhisto.registries.record_registry import RECORDS, register

REPO = Path(__file__).resolve().parents[1]


def test_the_guides_blocks_are_what_the_committed_records_render():
    """A guide's result block differs from `fedhisto records`' rendering of benchmarks/records/ only when it was
    typed or left stale: run `fedhisto records` (after a code change it adds the stale line)."""
    assert record_blocks.differing_blocks(REPO) == []


def test_every_block_of_the_guides_is_registered_and_every_registered_block_is_shown():
    shown = {m.group(2) for p in record_blocks.guide_paths(REPO) for m in record_blocks.BLOCK.finditer(p.read_text())}
    assert shown - set(RECORDS) == set(), "a guide shows a block no renderer writes"
    assert set(RECORDS) - shown == set(), "a registered block is shown in no guide"


def test_a_stages_code_reaches_the_plugins_registries_name_by_string_and_no_further():
    """The method registry names every method by a "module:Class" string, never an import: train's code must
    still include each method's file; the command line and the records package are no stage's code."""
    tree = Tree(REPO)
    train = stage_files("train", tree)
    assert {"src/fedhisto/methods/scaffold.py", "src/fedhisto/methods/fedadam.py", "workflow/rules/train.smk",
            "scripts/train.py", "src/fedhisto/train/loop.py"} <= set(train)
    for stage in ("cohort", "train", "accounting", "report", "experiments"):
        files = stage_files(stage, tree)
        assert "src/fedhisto/cli.py" not in files and not any("/records/" in f for f in files), stage


def _copy_repo(dest: Path) -> Path:
    """The package, scripts, workflow and configs of this checkout in a fresh git repository of one commit."""
    for name in ("src", "scripts", "workflow", "config", "Snakefile", "pyproject.toml"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dest / name)
    (dest / "docs").mkdir()
    (dest / "docs/one.md").write_text("# A guide\n\n<!-- generated:table8_communication begin -->\n"
                                      "<!-- generated:table8_communication end -->\n\nThe end.\n")
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.org"]
    subprocess.run([*git, "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "copy"], cwd=dest, check=True)
    return dest


def _run(copy: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(copy / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=600)


def test_a_block_says_when_its_stages_code_changed_since_it_was_recorded(tmp_path: Path):
    """A real stage (accounting) run from a committed copy of the repository, recorded and rendered: no stale
    line; the stage's code changed afterwards: `--check` fails and the block renders a line naming the stage
    and the file; a change outside the stage's code (the command line) leaves it fresh."""
    copy = _copy_repo(tmp_path / "repo")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=copy, capture_output=True, text=True).stdout.strip()
    proc = _run(copy, "scripts/accounting.py", "--config", "config/config.yaml", "--out",
                "results/accounting/communication.csv")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _run(copy, "-m", "fedhisto.cli", "records", "results")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stamp = json.loads((copy / "benchmarks/records/default/records.json").read_text())["blocks"]
    assert set(stamp) == {"table8_communication", "aggregator_traffic"}  # the blocks whose inputs this run made
    assert stamp["table8_communication"]["commits"] == [head]
    assert stamp["table8_communication"]["stages"]["accounting"] == {head: stage_digest("accounting", Tree(copy))}
    guide = (copy / "docs/one.md").read_text()
    assert f"commit {head[:7]}" in guide and "Stale" not in guide
    with (copy / "results/accounting/communication.csv").open() as fh:
        fedavg = next(r for r in csv.DictReader(fh) if r["method"] == "fedavg_peft")
    assert f"| fedavg_peft | {fedavg['trainable_parameters']} | {float(fedavg['per_round_mib']):.3f} |" in guide
    assert _run(copy, "-m", "fedhisto.cli", "records", "--check").returncode == 0

    cli = copy / "src/fedhisto/cli.py"
    cli.write_text(cli.read_text() + "\n# a change outside every stage's code\n")
    assert _run(copy, "-m", "fedhisto.cli", "records", "--check").returncode == 0

    stage = copy / "src/fedhisto/accounting/stage.py"
    stage.write_text(stage.read_text() + "\n# a deliberate change to the accounting stage's code\n")
    proc = _run(copy, "-m", "fedhisto.cli", "records", "--check")
    assert proc.returncode == 1 and "docs/one.md: table8_communication" in proc.stderr
    assert _run(copy, "-m", "fedhisto.cli", "records").returncode == 0
    guide = (copy / "docs/one.md").read_text()
    assert re.search(r"\*\*Stale:\*\* the code of stage accounting has changed since .*"
                     r"`src/fedhisto/accounting/stage\.py`", guide), guide
    assert _run(copy, "-m", "fedhisto.cli", "records", "--check").returncode == 0  # the stale line is the rendering


def test_a_commits_digest_equals_its_checked_out_tree(tmp_path: Path):
    """Reading a stage's code from a commit's git objects gives the digest of the same files checked out."""
    copy = _copy_repo(tmp_path / "repo")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=copy, capture_output=True, text=True).stdout.strip()
    commit, tree = Commit(head, copy), Tree(copy)
    for stage in ("train", "accounting", "experiments"):
        assert stage_files(stage, commit) == stage_files(stage, tree)
        assert stage_digest(stage, commit) == stage_digest(stage, tree) != ""


def _parse_md_table(text: str) -> list[list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]  # header, then rows after |---|


def test_the_main_tables_print_the_report_csvs_values(tmp_path: Path):
    """Tables 4 and 6 against the report's CSVs read by pandas: each method's mean, SD, and each
    comparison's difference and interval, rounded as printed."""
    from fedhisto.records import tables

    (tmp_path / "tables").mkdir()
    t4 = pd.DataFrame({"method": ["fedavg_peft", "fedstain"], "finalised_seeds": ["11 22", "11"],
                       "failed_seeds": ["", ""], "macro_f1_mean": [0.91567, 0.79661], "macro_f1_sd": [0.0034, 0.2088],
                       "worst_client_macro_f1_mean": [0.0, 0.5], "worst_client_macro_f1_sd": [0.0, 0.1],
                       "ece_mean": [0.1261, 0.115], "unavailable_client_rounds": [0, 2],
                       "caveat": ["", "fedstain: local steps are adamw"]})
    t4.to_csv(tmp_path / "tables/table4_internal.csv", index=False)
    text = tables.table4(tmp_path)
    rows = _parse_md_table(text)
    assert [r[0] for r in rows] == ["fedavg_peft", "fedstain †"]
    assert [float(r[2]) for r in rows] == pytest.approx(t4["macro_f1_mean"].round(4).tolist())
    assert [float(r[3]) for r in rows] == pytest.approx(t4["macro_f1_sd"].round(4).tolist())
    assert "† fedstain: local steps are adamw" in text and "unavailable client-rounds: fedstain 2" in text
    t6 = pd.DataFrame({"comparison": ["v2_vs_fedavg"] * 2, "method_seeds": ["11 22"] * 2, "reference_seeds": ["11 22"] * 2,
                       "metric": ["macro_f1", "accuracy"], "unit": ["image"] * 2, "method": [0.81, 0.8],
                       "reference": [0.82, 0.8], "difference": [-0.00583, 0.0], "ci_low": [-0.012, 0.0],
                       "ci_high": [-0.0014, 0.0], "p_two_sided": ["0.033", "1.0"], "p_delta_positive": [0.0, 0.0],
                       "n_resamples": [2000, 2000]})
    t6.to_csv(tmp_path / "tables/table6_bootstrap.csv", index=False)
    (row,) = _parse_md_table(tables.table6(tmp_path))  # macro-F1 only
    assert row[:2] == ["v2_vs_fedavg", "11 22"] and float(row[2]) == pytest.approx(-0.0058)
    assert row[3] == "[-0.0120, -0.0014]" and row[4] == "0.033"


def test_registering_a_block_checks_its_name_target_and_inputs():
    with pytest.raises(ValueError, match="lower-case"):
        register("Bad", "m:f", inputs=["a.csv"], stages=[])
    with pytest.raises(ValueError, match="module:function"):
        register("bad_target", "module.function", inputs=["a.csv"], stages=[])
    with pytest.raises(ValueError, match="inside a results folder"):
        register("bad_inputs", "m:f", inputs=["../secret.csv"], stages=[])
    with pytest.raises(ValueError, match="registered already"):
        register("table4_internal", "m:f", inputs=["a.csv"], stages=[])


# ------------------------------------------------------------------ blocks from committed records
def test_a_block_from_a_committed_record_renders_its_stamp_and_table_and_says_when_it_is_pending(tmp_path: Path):
    """A committed-record block (no results folder): stamped with the file, the command that writes it and the
    record's own commit, day and host; its pending sentence until the file exists; a broken file is named."""
    entry = RECORDS["reference_differences"]
    (tmp_path / "benchmarks/records").mkdir(parents=True)
    assert record_blocks.render_committed(entry, tmp_path).startswith("**Pending:** not recorded yet: "
                                                                      "`python benchmarks/reference_differences.py`")
    record = {"commit": "0123456789abcdef", "made_utc": "2030-01-02T03:04:05+00:00", "host": "CPU X (AVX2)",
              "references": [{"kind": "mechanism", "name": "metrics", "reference": "scikit-learn",
                              "test": "tests/t.py::test_m", "max_difference": 0.0, "known_defect": None}]}
    (tmp_path / entry.record).write_text(json.dumps(record))
    text = record_blocks.render_committed(entry, tmp_path)
    assert text.splitlines()[0] == ("*Generated by `fedhisto records` from `benchmarks/records/reference_differences"
                                    ".json`, written by `python benchmarks/reference_differences.py`: commit 0123456, "
                                    "made 2030-01-02, on CPU X (AVX2).*")
    assert "| `metrics` (mechanism) | scikit-learn | 0 | `tests/t.py::test_m` |" in text
    (tmp_path / entry.record).write_text("{not json")
    with pytest.raises(record_blocks.RecordError, match=r"reference_differences\.json: not JSON"):
        record_blocks.render_committed(entry, tmp_path)
    timing = RECORDS["first_command_timing"]
    assert record_blocks.render_committed(timing, tmp_path).startswith("**FIGURE PENDING:**")


def test_registering_a_committed_record_checks_its_path_and_command():
    with pytest.raises(ValueError, match="takes no inputs"):
        register("bad_mix", "m:f", inputs=["a.csv"], record="benchmarks/records/x.json", made_by="x")
    with pytest.raises(ValueError, match=r"\.json path inside the repository"):
        register("bad_path", "m:f", record="../x.json", made_by="x")
    with pytest.raises(ValueError, match="made_by"):
        register("bad_maker", "m:f", record="benchmarks/records/x.json")
    assert "bad_mix" not in RECORDS and "bad_path" not in RECORDS and "bad_maker" not in RECORDS


def test_recording_a_results_folder_leaves_the_committed_records_alone():
    assert {e.name for e in RECORDS.values() if e.record} == {"reference_differences", "first_command_timing"}
    assert all(not e.inputs and not e.stages for e in RECORDS.values() if e.record)


def _timing_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("first_command_timing", REPO / "benchmarks/first_command_timing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_timing_runs_the_readmes_first_command_step_by_step_in_one_shell(tmp_path: Path):
    """The script times the README's first ```bash block (the one tests/test_packaging.py holds to CI); its
    steps share one shell, as `&&` does (an activated environment carries to the next step), and a failing
    step stops it, named."""
    from test_packaging import readme_commands

    timing = _timing_script()
    assert timing.first_command(REPO / "README.md") == readme_commands(REPO)[0]
    (tmp_path / "env.sh").write_text("export FEDHISTO_TIMING_PROBE=set\n")
    steps = timing.run_timed("touch made.txt && . ./env.sh && test \"$FEDHISTO_TIMING_PROBE\" = set && sleep 0.2",
                             tmp_path, dict(os.environ), tmp_path / "log.txt")
    assert [s["command"] for s in steps] == ["touch made.txt", ". ./env.sh", 'test "$FEDHISTO_TIMING_PROBE" = set',
                                             "sleep 0.2"]
    assert (tmp_path / "made.txt").is_file() and all(s["wall_s"] >= 0 for s in steps)
    assert 0.15 <= steps[-1]["wall_s"] < 5  # the shell's clock around a 0.2 s step (a hang guard above)
    with pytest.raises(SystemExit, match=r"failed at step 2 \('false'"):
        timing.run_timed("true && false && true", tmp_path, dict(os.environ), tmp_path / "log2.txt")


def test_the_timing_block_states_the_figure_its_parts_the_cores_and_the_load():
    from fedhisto.records.first_command import duration, render

    record = {"steps": [{"command": "python3 -m venv .venv", "wall_s": 3.4}, {"command": "pip install -e .", "wall_s": 71.2},
                        {"command": "snakemake --cores 2 all", "wall_s": 290.6}],
              "wall_s": 365.2, "cores": 2, "load_before": [0.04, 0.1, 0.2]}
    assert render(record) == ("The first command above took **6 min 5 s** in a fresh clone with an empty pip cache, "
                              "on 2 cores, load average 0.04 when it started: 1 min 15 s to create the environment and "
                              "install; 4 min 51 s for `snakemake --cores 2 all`.\n")
    assert (duration(59.4), duration(60), duration(3599.6)) == ("59 s", "1 min 0 s", "60 min 0 s")
