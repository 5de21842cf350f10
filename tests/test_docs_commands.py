"""Every shell command the guides give is exercised, or says that it is not.

A command in README.md or docs/*.md (not the changelog, which records what was run then) sits in a
```bash block. Each step of it is checked by what it is: a `snakemake` command is dry-run (-n) as written,
a `fedhisto` or `python <script>` command must exist and know every option it is given (its --help), a
`pytest -m` marker must be declared, a `bash <script>` must parse and know its options, a `pip install`
must name extras the package declares, and a command `.ci/run` runs verbatim counts as run. A block whose
first line is `# not run by the tests: <why>` is skipped, and only such a block. ```text blocks hold output
and synopses, never a command to copy.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
from test_study_configs import roots_overlay  # noqa: F401  (config/paper.yaml's roots, test-made)

REPO = Path(__file__).resolve().parents[1]
NOT_RUN = "# not run by the tests:"
COMMAND_WORDS = ("snakemake", "fedhisto", "python", "python3", "pip", "pytest", "bash", "apt-get",
                 "huggingface-cli", "ssh-keygen", "git", ".")


def guides() -> list[Path]:
    return [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "changelog.md")]


def fenced(path: Path) -> list[tuple[str, int, str]]:
    """(language, first line number, body) of every fenced block, indented ones included."""
    text = path.read_text()
    return [(m.group(2), text[:m.start()].count("\n") + 1, m.group(3))
            for m in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, flags=re.S | re.M)]


def steps(body: str) -> list[list[str]]:
    """A block's commands, continuation lines joined and comments dropped, split at ``&&``."""
    out: list[list[str]] = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1:]
    return [w for w in out if w]


BLOCKS = [(path, line, body) for path in guides() for lang, line, body in fenced(path) if lang in ("bash", "sh")]
# each distinct command once, named by where it first appears
COMMANDS = list({tuple(words): (f"{path.name}:{line}", words) for path, line, body in reversed(BLOCKS)
                 if not body.lstrip().startswith(NOT_RUN) for words in reversed(steps(body))}.values())[::-1]


def test_the_guides_give_commands_and_mark_the_unrun_ones_with_a_reason():
    assert len(COMMANDS) >= 20, [where for where, _ in COMMANDS]
    marked = 0
    for path, line, body in BLOCKS:
        lines = body.strip().splitlines()
        at = [i for i, text in enumerate(lines) if NOT_RUN in text]
        assert at in ([], [0]), f"{path.name}:{line}: the marker goes on the block's first line, once"
        if at:
            marked += 1
            assert len(lines[0].strip()) > len(NOT_RUN) + 5, f"{path.name}:{line}: say why it is not run"
    assert marked < len(BLOCKS) / 4, "most commands in the guides should be exercised, not marked"


@pytest.mark.parametrize("path", guides(), ids=lambda p: p.name)
def test_no_command_hides_in_a_text_block(path: Path):
    for lang, line, body in fenced(path):
        if lang in ("text", ""):
            words = body.split()
            looks_run = words and words[0] in COMMAND_WORDS and not (len(words) > 1 and words[1].endswith(":"))
            assert not looks_run, f"{path.name}:{line}: a command in a ```{lang} block; make it ```bash"


@cache
def ci_steps() -> tuple[str, ...]:
    lanes = re.findall(r"^(?:lane|start) [\w-]+ '(.*)'$", (REPO / ".ci/run").read_text(), flags=re.M)
    return tuple(step.strip() for lane in lanes for step in lane.split(" && "))


@cache
def help_text(*command: str) -> str:
    proc = subprocess.run([*command, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(command)} --help: {proc.stderr[-2000:]}"
    return proc.stdout


def _options_known(words: list[str], known: str, where: str) -> None:
    for word in words:
        option = word.split("=")[0]
        if option.startswith("--"):
            assert re.search(re.escape(option) + r"\b", known), f"{where}: {' '.join(words)}: no option {option}"


def _dry_run(words: list[str], where: str, snakemake_bin: str, tmp_path: Path, request) -> None:
    args = [re.sub(r"<[^>]+>", "x", w) for w in words[1:]]  # <account> and the like: any value parses
    if "--configfile" in args and "config/paper.yaml" in args:  # the study's data roots, made by the test
        at = max(i for i, a in enumerate(args) if a.endswith((".yaml", ".yml")))
        args.insert(at + 1, str(request.getfixturevalue("roots_overlay")))
    (tmp_path / "config").symlink_to(REPO / "config")  # the Snakefile's own config/config.yaml, from -d
    proc = subprocess.run([snakemake_bin, "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "-n", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{where}: {' '.join(words)}\n{(proc.stdout + proc.stderr)[-3000:]}"


@pytest.mark.parametrize(("where", "words"), COMMANDS, ids=[f"{w}:{' '.join(c)[:60]}" for w, c in COMMANDS])
def test_each_command_in_the_guides_is_exercised(where: str, words: list[str], snakemake_bin: str, tmp_path: Path,
                                                request):
    line = " ".join(words)
    if any(line == step or shlex.join(words) == step for step in ci_steps()):
        return  # .ci/run runs it as written (tests/test_packaging.py keeps the README and CI in step)
    head = words[0]
    if head == "snakemake":
        _dry_run(words, where, snakemake_bin, tmp_path, request)
    elif head == "fedhisto":
        assert len(words) > 1, where
        _options_known(words[2:], help_text("fedhisto", words[1]), where)
    elif head in ("python", "python3") and words[1:3] == ["-m", "venv"]:
        pass
    elif head in ("python", "python3"):
        script = REPO / words[1]
        assert script.is_file(), f"{where}: no {words[1]}"
        _options_known(words[2:], help_text(sys.executable, str(script)), where)
    elif head == "." or head == "source":
        assert re.fullmatch(r"\.venv[\w-]*/bin/activate", words[1]), f"{where}: {line}"
    elif head == "pip":
        assert words[1] == "install", f"{where}: {line}"
        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for word in words[2:]:
            if word.startswith(".["):
                for extra in word[2:-1].split(","):
                    assert extra in extras, f"{where}: pyproject.toml declares no extra {extra!r}"
    elif head == "pytest":
        markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
        declared = {m.split(":")[0] for m in markers}
        for i, word in enumerate(words):
            if word == "-m":
                assert words[i + 1] in declared, f"{where}: no pytest marker {words[i + 1]!r}"
            elif word.startswith("tests/"):
                assert (REPO / word.split("::")[0]).is_file(), f"{where}: no {word}"
    elif head == "bash":
        script = REPO / words[1]
        assert script.is_file(), f"{where}: no {words[1]}"
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, f"{where}: {words[1]} does not parse"
        _options_known(words[2:], script.read_text(), where)
    else:
        pytest.fail(f"{where}: {line}: no test runs this; check it here, or start its block with "
                    f"'{NOT_RUN} <why>'")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path):
    text = re.sub(r"^( *)```.*?^\1```", "", path.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.*)$", text, flags=re.M):
        slug = _slug(heading)
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


@pytest.mark.parametrize("path", [*guides(), REPO / "docs/changelog.md"], ids=lambda p: p.name)
def test_every_link_between_the_guides_resolves(path: Path):
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file) if file else path
        assert linked.exists(), f"{path.name}: no file {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in set(_anchors(linked)), f"{path.name}: no heading for {target}"


@pytest.mark.parametrize("path", guides(), ids=lambda p: p.name)
def test_the_guides_cite_no_issue_numbers_or_missing_sources(path: Path):
    """History (issues, sessions, dated measurements) lives in docs/changelog.md; sources the repository
    does not hold are not cited."""
    text = path.read_text()
    assert not re.findall(r"(?i)issue [0-9]+|#[0-9]{2}\b", text)
    assert not re.findall(r"SPEC\.md|SPEC section|papers/|/work/shared", text)
