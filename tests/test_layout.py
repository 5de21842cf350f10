"""The project's structure, from its own files: each Snakemake stage in its three places (the rule file,
the package with its ``stage.py`` entry, the thin script), and the package's imports as a layered house:
no circle between modules or between packages (a circle between packages is an arrow that runs back up
a floor), no module name used twice, few modules directly under ``src/fedhisto/``."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "fedhisto"
RULES = sorted(p for p in (ROOT / "workflow" / "rules").glob("*.smk") if p.stem != "common")


@pytest.mark.parametrize("rule_file", RULES, ids=lambda p: p.stem)
def test_a_stage_lives_in_its_three_places(rule_file: Path) -> None:
    stage = rule_file.stem
    assert (SRC / stage / "stage.py").is_file(), f"stage {stage}: no src/fedhisto/{stage}/stage.py"
    script = ROOT / "scripts" / f"{stage}.py"
    assert script.is_file(), f"stage {stage}: no scripts/{stage}.py"
    scripts = re.findall(r"^\s*script:\s*\n\s*\"([^\"]+)\"", rule_file.read_text(), re.M)
    assert scripts, f"{rule_file.name} runs no script"
    assert f"../../scripts/{stage}.py" in scripts, f"{rule_file.name} never runs scripts/{stage}.py"
    # a stage may rerun another stage's step (the experiments retrain conditions through train/predict/stain)
    stages = {p.stem for p in RULES}
    foreign = {s for s in scripts if Path(s).stem not in stages}
    assert not foreign, f"{rule_file.name} runs scripts of no stage: {sorted(foreign)}"
    assert f"fedhisto.{stage}.stage" in script.read_text(), f"scripts/{stage}.py does not call fedhisto.{stage}.stage"
    assert f'include: "workflow/rules/{rule_file.name}"' in (ROOT / "Snakefile").read_text()


def test_every_stage_script_has_its_rule_file() -> None:
    # scripts/site_prepare.py is the site workflow's (workflow/site/Snakefile), not a pipeline stage
    stages = {p.stem for p in RULES}
    assert {p.stem for p in (ROOT / "scripts").glob("*.py")} - stages == {"site_prepare"}
    assert "scripts/site_prepare.py" in (ROOT / "workflow" / "site" / "Snakefile").read_text()


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every fedhisto module each module imports, at any depth of its code (a lazy import is an arrow too)."""
    modules = {_module(p): p for p in SRC.rglob("*.py")}
    out: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedhisto"):
                assert node.level == 0
                targets = [f"{node.module}.{a.name}" for a in node.names]
                out[name] |= {t for t in targets if t in modules} or {node.module}
            elif isinstance(node, ast.Import):
                out[name] |= {a.name for a in node.names if a.name.startswith("fedhisto.")}
        out[name] = {t for t in out[name] if t in modules and t != name}
    return out


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _room(module: str) -> str:
    """A module's package directly under fedhisto (or the top-level module itself)."""
    return module.split(".")[1] if "." in module else module


def test_no_circle_between_modules_or_packages() -> None:
    edges = _imports()
    assert _circles(edges) == []
    rooms: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        rooms[_room(a)] |= {_room(b) for b in targets if _room(b) not in (_room(a), "fedhisto")}
    assert _circles(rooms) == [], "packages import each other: one of these arrows runs back up"


def test_no_module_name_is_used_twice_and_the_top_level_is_small() -> None:
    names = defaultdict(list)
    for p in SRC.rglob("*.py"):
        if p.name not in ("__init__.py", "stage.py"):
            names[p.name].append(str(p.relative_to(SRC)))
    assert {n: ps for n, ps in names.items() if len(ps) > 1} == {}
    assert len(list(SRC.glob("*.py"))) <= 15


def test_a_circle_is_found() -> None:  # the checker itself can fail
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
