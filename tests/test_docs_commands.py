"""Every command the guides give is run as written, or says why it is not.

A guide (README.md or docs/*.md but the changelog, which records what was run then) gives commands in
```bash blocks and in prose backticks. Each is checked by the parser of the program it calls, on the
exact words a user would copy:

- ``fedhisto ...`` is parsed by ``fedhisto.cli.build_parser()`` (required arguments, values, nargs);
- ``python <script> ...`` and ``python -m <module> ...`` run the script until its own argparse parser has
  parsed the words, then stop (nothing of the script's work runs); ``python -c`` code runs;
- ``snakemake ...`` is parsed by Snakemake's own parser (``snakemake.cli.parse_args``, which reads the
  workflow's default profile ``profiles/default/`` as Snakemake does): a command that would execute must
  get its cores from the command line or that profile, and no target may be swallowed by an option
  that takes several values (``--forcerun rule target`` builds ``all``); then it is dry-run as written;
- a ``pytest -m`` marker must be declared, a ``bash <script>`` must parse and know its options, a
  ``pip install`` must name extras the package declares, and a command `.ci/run` runs verbatim counts
  as run.

A ```bash block whose first line is ``# not run by the tests: <why>`` is skipped, and only such a block;
a prose command that cannot run here goes into such a block. A prose span with a placeholder the user
fills in (``FILE``, ``...``, ``[--option]``, ``a|b``) is a synopsis: its command and options must exist.
A ```yaml block is a config overlay: laid over ``config/config.yaml`` (or the file a ``# over
config/paper.yaml`` line at its top names) it must pass ``fedhisto check-config``; one whose first line is
``# file: NAME`` is also the file ``NAME`` that commands of the guides name. ```text blocks hold output,
never a command to copy.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml
from test_study_configs import roots_overlay  # noqa: F401  (config/paper.yaml's roots, test-made)

REPO = Path(__file__).resolve().parents[1]
NOT_RUN = "# not run by the tests:"
COMMAND_WORDS = ("snakemake", "fedhisto", "python", "python3", "pip", "pytest", "bash", "apt-get",
                 "huggingface-cli", "ssh-keygen", "git", "sha256sum", ".", "source")
#: Snakemake options that take several values: a target written after one of them is taken as its value.
SWALLOWING = ("forcerun", "until", "omit_from", "configfile", "config", "set_resources", "default_resources",
              "set_threads", "resources", "allowed_rules", "batch")


def guides() -> list[Path]:
    return [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "changelog.md")]


def fenced(path: Path) -> list[tuple[str, int, str]]:
    """(language, first line number, body) of every fenced block, indented ones included."""
    text = path.read_text()
    return [(m.group(2), text[:m.start()].count("\n") + 1, textwrap_dedent(m.group(3), len(m.group(1))))
            for m in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, flags=re.S | re.M)]


def textwrap_dedent(body: str, indent: int) -> str:
    return "\n".join(line[indent:] if line[:indent].strip() == "" else line for line in body.splitlines()) + "\n"


def prose(path: Path) -> str:
    """The guide without its fenced blocks (their lines kept blank, so line numbers stay)."""
    return re.sub(r"^( *)```.*?^\1```", lambda m: "\n" * m.group(0).count("\n"), path.read_text(),
                  flags=re.S | re.M)


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


def is_synopsis(span: str) -> bool:
    """A prose span with a placeholder the reader fills in, not a command to copy as it stands; or the name
    of a command alone (`fedhisto export`, `fedhisto site prepare`)."""
    words = span.split()
    if words[0] == "fedhisto" and len(words) <= 3 and not any(w.startswith("-") for w in words):
        return True
    return bool(re.search(r"\.\.\.|\[|\||\b[A-Z][A-Z_]{1,}\b(?![-\w./])|\b[A-Z]=|=[A-Z]\b", span))


def prose_commands(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every inline code span that starts with a command word and has an argument."""
    text = prose(path)
    out = []
    for m in re.finditer(r"(?<!`)`([^`]+?)`(?!`)", text):
        if "\n\n" in m.group(1):
            continue
        span = " ".join(m.group(1).split())
        words = span.split()
        if len(words) > 1 and words[0] in COMMAND_WORDS:
            out.append((text[:m.start()].count("\n") + 1, span))
    return out


BLOCKS = [(path, line, body) for path in guides() for lang, line, body in fenced(path) if lang in ("bash", "sh")]
PROSE = [(path, line, span) for path in guides() for line, span in prose_commands(path)]


def _commands() -> list[tuple[str, list[str]]]:
    """Each distinct command once, named by where it first appears."""
    found: dict[tuple[str, ...], str] = {}
    for path, line, body in BLOCKS:
        if not body.lstrip().startswith(NOT_RUN):
            for words in steps(body):
                found.setdefault(tuple(words), f"{path.name}:{line}")
    for path, line, span in PROSE:
        if not is_synopsis(span):
            found.setdefault(tuple(shlex.split(span)), f"{path.name}:{line}")
    return [(where, list(words)) for words, where in found.items()]


COMMANDS = _commands()
SYNOPSES = [(f"{path.name}:{line}", span) for path, line, span in PROSE if is_synopsis(span)]


def test_the_guides_give_commands_and_mark_the_unrun_ones_with_a_reason():
    assert len(COMMANDS) >= 40, [where for where, _ in COMMANDS]
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


def _filled(words: list[str]) -> list[str]:
    """Placeholders a user fills in (``<account>``, ``{name}``) given a value that parses."""
    return [re.sub(r"<[^>]+>|\{[a-z_]+\}", "x", w) for w in words]


# ------------------------------------------------------------------ files the guides write (```yaml # file:)
@cache
def guide_files() -> dict[str, str]:
    """NAME -> text of every ```yaml block whose first line is ``# file: NAME``."""
    files: dict[str, str] = {}
    for path in guides():
        for lang, line, body in fenced(path):
            first = body.splitlines()[0] if body.strip() else ""
            if lang == "yaml" and (m := re.fullmatch(r"# file: (\S+)", first.strip())):
                assert files.get(m.group(1), body) == body, f"{path.name}:{line}: two different {m.group(1)}"
                files[m.group(1)] = body
    return files


def _with_guide_files(args: list[str], folder: Path) -> list[str]:
    out = []
    for arg in args:
        if arg in guide_files():
            target = folder / arg
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(guide_files()[arg])
            arg = str(target)
        out.append(arg)
    return out


# ------------------------------------------------------------------ fedhisto and python: their own parsers
def _parse_fedhisto(argv: list[str], where: str) -> None:
    from fedhisto.cli import ALIASES, build_parser

    if tuple(argv[:2]) in ALIASES:
        argv = [ALIASES[tuple(argv[:2])], *argv[2:]]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            if exc.code:  # --help or --version exit 0
                pytest.fail(f"{where}: fedhisto {shlex.join(argv)}: {err.getvalue().strip()[-600:]}")


#: Runs a script or module until its argparse parser has parsed sys.argv, then stops with exit 0.
PARSE_ONLY = """
import argparse, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parsed(self, args=None, namespace=None):
    parse(self, args, namespace)
    print("fedhisto-docs-test: parsed", flush=True)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parsed
kind, target, *rest = sys.argv[1:]
sys.argv = [target, *rest]
runpy.run_module(target, run_name="__main__", alter_sys=True) if kind == "-m" else runpy.run_path(target, run_name="__main__")
raise SystemExit("fedhisto-docs-test: the program ended without parsing its arguments with argparse")
"""


def _parse_python(words: list[str], where: str) -> None:
    if words[1] == "-c":
        proc = subprocess.run([sys.executable, *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{where}: {shlex.join(words)}: {proc.stderr[-2000:]}"
        return
    kind, target = ("-m", words[2]) if words[1] == "-m" else ("-f", words[1])
    if kind == "-f":
        assert (REPO / target).is_file(), f"{where}: no {target}"
    proc = subprocess.run([sys.executable, "-c", PARSE_ONLY, kind, target, *words[3 if kind == "-m" else 2:]],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    done = "usage:" in proc.stdout if {"-h", "--help"} & set(words) else "fedhisto-docs-test: parsed" in proc.stdout
    assert proc.returncode == 0 and done, \
        f"{where}: {shlex.join(words)}: {(proc.stdout + proc.stderr)[-2000:]}"


# ------------------------------------------------------------------ snakemake: its own parser, then a dry run
@contextlib.contextmanager
def _in_repo():
    before = os.getcwd()
    os.chdir(REPO)  # the user runs from the repository root, where Snakemake finds profiles/default
    try:
        yield
    finally:
        os.chdir(before)


def snakemake_args(argv: list[str]):
    """Snakemake's own reading of a command line in the repository root (default profile included)."""
    from snakemake.cli import parse_args

    err = io.StringIO()
    with _in_repo(), contextlib.redirect_stderr(err):
        try:
            return parse_args(argv)[1]
        except SystemExit as exc:
            raise AssertionError(f"snakemake {shlex.join(argv)}: {err.getvalue().strip()[-800:]}") from exc


def executes(args) -> bool:
    """Whether Snakemake would run jobs (not a dry run, a lint, a report or a listing)."""
    quiet = ("dryrun", "touch", "lint", "report", "list_rules", "list_target_rules", "summary", "detailed_summary",
             "dag", "rulegraph", "filegraph", "unlock", "cleanup_metadata", "delete_all_output", "print_compilation")
    return not any(getattr(args, name, None) for name in quiet)


def check_snakemake_parse(words: list[str], where: str) -> None:
    argv = _filled(words[1:])
    try:
        args = snakemake_args(argv)
    except AssertionError as exc:
        pytest.fail(f"{where}: {exc}")
    line = shlex.join(words)
    local = args.executor in (None, "local")
    if executes(args) and local:
        assert args.cores is not None or args.jobs is not None, (
            f"{where}: {line}: Snakemake stops with 'cores have to be specified for local execution': "
            "give --cores, or rely on profiles/default")
    targets = {str(t) for t in args.targets or ()}
    for option in SWALLOWING:
        values = getattr(args, option, None) or ()
        values = values.items() if isinstance(values, dict) else values
        for value in map(str, values):
            if value.startswith("results/") or value in ("all", "experiments"):
                assert targets, (f"{where}: {line}: --{option.replace('_', '-')} takes {value!r} as its value, "
                                 "so Snakemake builds the default target `all`: put the target before the option")


def _dry_run(words: list[str], where: str, snakemake_bin: str, tmp_path: Path, request) -> None:
    args = _with_guide_files(_filled(words[1:]), tmp_path / "guide_files")
    if "--configfile" in args and "config/paper.yaml" in args:  # the study's data roots, made by the test
        at = max(i for i, a in enumerate(args) if a.endswith((".yaml", ".yml")))
        args.insert(at + 1, str(request.getfixturevalue("roots_overlay")))
    work = tmp_path / "work"
    work.mkdir()
    (work / "config").symlink_to(REPO / "config")  # the Snakefile's own config/config.yaml, from -d
    snakefile = [] if {"-s", "--snakefile"} & set(args) else ["-s", str(REPO / "Snakefile")]
    proc = subprocess.run([snakemake_bin, *snakefile, "-d", str(work), "-n", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{where}: {shlex.join(words)}\n{(proc.stdout + proc.stderr)[-3000:]}"


@pytest.mark.parametrize(("where", "words"), COMMANDS, ids=[f"{w}:{' '.join(c)[:60]}" for w, c in COMMANDS])
def test_each_command_in_the_guides_is_exercised(where: str, words: list[str], snakemake_bin: str, tmp_path: Path,
                                                request):
    line = " ".join(words)
    if any(line == step or shlex.join(words) == step for step in ci_steps()):
        return  # .ci/run runs it as written (tests/test_packaging.py keeps the README and CI in step)
    head = words[0]
    if head == "snakemake":
        check_snakemake_parse(words, where)
        if not {"--lint", "--report"} & set(words):  # a lint runs in test_packaging; a report needs results
            _dry_run(words, where, snakemake_bin, tmp_path, request)
    elif head == "fedhisto":
        assert len(words) > 1, where
        _parse_fedhisto(_filled(words[1:]), where)
    elif head in ("python", "python3") and words[1:3] == ["-m", "venv"]:
        pass
    elif head in ("python", "python3"):
        _parse_python(_filled(words), where)
    elif head in (".", "source"):
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
        for word in words[2:]:
            if word.startswith("--"):
                assert re.search(re.escape(word.split("=")[0]) + r"\b", script.read_text()), f"{where}: no {word}"
    else:
        pytest.fail(f"{where}: {line}: no test runs this; check it here, or put it in a ```bash block that starts "
                    f"with '{NOT_RUN} <why>'")


@pytest.mark.parametrize(("where", "span"), SYNOPSES, ids=[f"{w}:{s[:60]}" for w, s in SYNOPSES])
def test_each_synopsis_names_a_command_and_options_that_exist(where: str, span: str):
    words = span.split()
    if words[0] == "fedhisto":
        from fedhisto.cli import build_parser

        sub = next(a for a in build_parser()._actions if a.dest == "command")
        name = words[1]
        if name.isupper() or "|" in name:  # `fedhisto COMMAND --help`, `fedhisto site|federate`
            return
        assert name in sub.choices, f"{where}: `{span}`: no command fedhisto {name}"
        known = {o for a in sub.choices[name]._actions for o in a.option_strings}
        for word in words[2:]:
            option = word.strip("[]").split("=")[0]
            if option.startswith("--"):
                assert option in known, f"{where}: `{span}`: fedhisto {name} has no option {option}"
    elif words[0] == "snakemake":
        from snakemake.cli import get_argument_parser

        known = {o for a in get_argument_parser()._actions for o in a.option_strings}
        for word in words[1:]:
            option = word.strip("[]").split("=")[0]
            if option.startswith("-") and option != "-":
                assert option in known, f"{where}: `{span}`: snakemake has no option {option}"
    elif words[0] in ("python", "python3"):
        assert "<" in span or (REPO / words[1]).is_file() or words[1] == "-m", f"{where}: `{span}`: no {words[1]}"


# ------------------------------------------------------------------ yaml blocks: config overlays that validate
YAML_BLOCKS = [(path, line, body) for path in guides() for lang, line, body in fenced(path) if lang == "yaml"]


@pytest.mark.parametrize(("path", "line", "body"), YAML_BLOCKS, ids=[f"{p.name}:{n}" for p, n, _ in YAML_BLOCKS])
def test_each_config_block_of_the_guides_passes_check_config(path: Path, line: int, body: str, tmp_path: Path,
                                                             request):
    first = body.splitlines()[0].strip() if body.strip() else ""
    if first.startswith(NOT_RUN):
        assert len(first) > len(NOT_RUN) + 5, f"{path.name}:{line}: say why it is not checked"
        return
    assert isinstance(yaml.safe_load(body), dict), f"{path.name}:{line}: a config block is a mapping"
    head = "\n".join(body.splitlines()[:2])  # `# over FILE` on the first line, or after `# file: NAME`
    base = m.group(1) if (m := re.search(r"^# over (\S+)", head, flags=re.M)) else "config/config.yaml"
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(body)
    files = [str(REPO / base), str(overlay)]
    if base == "config/paper.yaml":  # the study's data roots, made by the test, laid last
        files.append(str(request.getfixturevalue("roots_overlay")))
    from fedhisto.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["check-config", *files])
    assert rc == 0, f"{path.name}:{line}: the block laid over {base} is refused: {err.getvalue().strip()}"


# ------------------------------------------------------------------ the default profile and the SLURM one
def test_snakemake_runs_without_cores_through_the_default_profile_and_the_command_line_wins():
    assert snakemake_args(["all"]).cores == os.cpu_count()  # profiles/default: cores: all
    assert snakemake_args(["--cores", "1", "results/bootstrap/v2_vs_fedavg.json"]).cores == 1
    assert snakemake_args(["--workflow-profile", "none", "all"]).cores is None  # the profile is what gives them


def test_the_slurm_profile_replaces_the_default_one():
    """The cluster command reads workflow/profiles/slurm alone: nothing of profiles/default (cores) joins it."""
    from test_slurm import README_COMMAND

    args = snakemake_args(_filled(README_COMMAND.split()[1:]))
    slurm = yaml.safe_load((REPO / "workflow/profiles/slurm/config.yaml").read_text())
    assert args.executor == "slurm" and args.jobs == slurm["jobs"] and args.retries == slurm["retries"]
    assert args.cores is None


def test_a_swallowed_target_and_missing_cores_are_caught():
    """The checker itself fails on the two ways a snakemake command breaks as typed."""
    with pytest.raises(AssertionError, match="builds the default target"):
        check_snakemake_parse(["snakemake", "--forcerun", "classify_folder", "results/classify/x/predictions.csv"],
                              "here")
    with pytest.raises(AssertionError, match="cores have to be specified"):
        check_snakemake_parse(["snakemake", "--workflow-profile", "none", "all"], "here")
    check_snakemake_parse(["snakemake", "results/classify/x/predictions.csv", "--forcerun", "classify_folder"], "here")
    with pytest.raises(pytest.fail.Exception, match="required"):
        _parse_fedhisto(["probe-encoder", "--images", "x"], "here")


# ------------------------------------------------------------------ links, sources, dates
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


#: What dates a passage to a day or a machine: a calendar date, a clock time, a host's name or "this machine".
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d UTC\b|\bUTC\b|(?i:\bthis machine\b|\bsandbox\b|\bthis "
                   r"host\b|\bXeon\b|\bEPYC\b|\bload average\b|\bshared (?:CPU )?cores\b|\bbuild machine\b)")


def outside_generated(text: str) -> str:
    """The text with every generated block (``<!-- generated:NAME begin -->`` .. ``end -->``) blanked."""
    return re.sub(r"<!-- generated:(\S+) begin -->.*?<!-- generated:\1 end -->",
                  lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)


@pytest.mark.parametrize("path", guides(), ids=lambda p: p.name)
def test_no_dated_passage_outside_generated_blocks(path: Path):
    """A date, a clock time or a host belongs in a generated result block (which says which run and code
    made it) or in docs/changelog.md, never in a guide's own words."""
    text = re.sub(r"\]\([^)]*\)", "]()", outside_generated(path.read_text()))  # a link's target names a heading
    found = [(text[:m.start()].count("\n") + 1, m.group(0)) for m in DATED.finditer(text)]
    assert not found, f"{path.name}: dated passages at {found}"


def test_the_guides_are_short():
    """Half the words they had: a guide says how, the changelog and benchmarks/records/ what was measured."""
    words = {p.name: len(p.read_text().split()) for p in guides()}  # as `wc -w` counts them
    assert words["README.md"] <= 1200, words
    assert sum(words.values()) <= 24000, words


# ------------------------------------------------------------------ code names: every module, file and name exists
SRC = REPO / "src" / "fedhisto"


@cache
def _repo_files() -> tuple[str, ...]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return tuple(out)


def _defines(module_file: Path, name: str) -> bool:
    """Whether a module defines ``name`` at its top level (a def, a class, an assignment or an import)."""
    import ast

    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name.split(".")[0]) == name
                                                                  for a in node.names):
            return True
    return False


@cache
def _schema() -> dict:
    import json

    return json.loads((REPO / "workflow/schemas/config.schema.json").read_text())


def is_config_key(span: str) -> bool:
    """Whether a dotted span is a key path of the config (``train.max_rounds``, ``model.encoder.local_dir``),
    by the workflow's JSON schema; method and experiment blocks (``train.scaffold.local_lr``) included."""
    schema = _schema()
    node = schema
    for part in span.split("."):
        while "$ref" in node or "anyOf" in node or "allOf" in node:
            if "$ref" in node:
                node = schema["$defs"][node["$ref"].split("/")[-1]]
            else:
                options = [o for o in node.get("anyOf", node.get("allOf", [])) if "properties" in o or "$ref" in o]
                if not options:
                    return False
                node = options[0]
        if node.get("type") == "object" and "properties" not in node:
            return True  # a block the schema leaves open (experiments: typed by each experiment's class)
        props = node.get("properties", {})
        if part not in props:
            return False
        node = props[part]
    return True


FILE_SUFFIXES = {"json", "csv", "yaml", "yml", "md", "html", "png", "pt", "safetensors", "txt", "log", "db", "crt",
                 "pem", "key", "pub", "sock", "jpg", "jpeg", "tif", "tiff", "py", "smk", "toml", "sh", "rst"}


def code_name_problem(span: str) -> str | None:
    """Why a code span naming a file or a module of the project names nothing that exists, else None.

    ``x/y.py`` must be a file (from the root, under ``src/fedhisto/`` or as the tail of a tracked path);
    ``fedhisto.a.b.name`` must be a module and, after it, a name the module defines. A dotted span that
    starts with one of the package's subpackages (``train.loop``, ``privacy.site.DPSite``) is checked the
    same way once its second part is one of that subpackage's modules; otherwise it is a config key
    (``train.max_rounds``) and not checked here."""
    if re.search(r"[<>{}*\s]", span):
        return None
    if span.split("/")[0] in ("flwr", "torch", "peft", "transformers", "opacus", "timm", "snakemake"):
        return None  # another project's file
    if span.endswith(".py"):
        found = ((REPO / span).is_file() or (SRC / span).is_file()
                 or any(f.endswith("/" + span) for f in _repo_files()))
        return None if found else f"no file {span}"
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", span) or span.rsplit(".", 1)[1] in FILE_SUFFIXES:
        return None
    parts = span.split(".")
    strict = parts[0] == "fedhisto"
    parts = parts[1:] if strict else parts
    if not strict:
        if is_config_key(span):
            return None
        second = SRC / parts[0] / parts[1]
        module_like = (SRC / parts[0]).is_dir() and (second.is_dir() or second.with_suffix(".py").is_file()
                                                     or parts[-1][:1].isupper())
        if not module_like:
            if parts[0] in _schema()["properties"]:
                return f"no config key {span}"
            return None  # `stats.family_links`: a key of a JSON file, not a module
    here, k = SRC, 0
    while k < len(parts) and (here / parts[k]).is_dir():
        here, k = here / parts[k], k + 1
    module = here / f"{parts[k]}.py" if k < len(parts) else here / "__init__.py"
    if k < len(parts) and module.is_file():
        k += 1
    elif k < len(parts):
        module = here / "__init__.py"
    if k == len(parts):
        return None if module.is_file() else f"no module {span}"
    if not module.is_file():
        return f"no module for {span}"
    return None if _defines(module, parts[k]) else f"{module.relative_to(REPO)} defines no {parts[k]} ({span})"


@pytest.mark.parametrize("path", guides(), ids=lambda p: p.name)
def test_every_code_name_in_the_guides_exists(path: Path):
    """A module, file or function the guides name is one the code has (names go stale when code moves)."""
    text = prose(path)
    problems = []
    for m in re.finditer(r"(?<!`)`([^`\n]+?)`(?!`)", text):
        for span in re.split(r"[\s,()]+", m.group(1)):
            span = span.strip("'\":;").split("(")[0]
            if span and (why := code_name_problem(span)):
                problems.append(f"{path.name}:{text[:m.start()].count(chr(10)) + 1}: {why}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ statements the code could contradict
def test_the_configuration_guides_error_example_is_what_check_config_prints(tmp_path: Path):
    """configuration.md shows check-config's refusal of one bad value: the example is the real message."""
    text = (REPO / "docs/configuration.md").read_text()
    shown = next(body.strip() for lang, _, body in fenced(REPO / "docs/configuration.md") if lang == "text"
                 and "invalid configuration" in body)
    key, value = re.search(r"key '([\w.]+)': '(\w+)'", shown).groups()
    overlay: dict = {}
    node = overlay
    for part in key.split(".")[:-1]:
        node = node.setdefault(part, {})
    node[key.split(".")[-1]] = value
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(overlay))
    from fedhisto.cli import main

    err = io.StringIO()
    with _in_repo(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["check-config", "config/config.yaml", str(tmp_path / "profile.yaml")]) == 2
    assert err.getvalue().strip().replace(str(tmp_path / "profile.yaml"), "profile.yaml") == shown
    assert shown in text


def test_the_privacy_guides_method_table_is_what_each_method_declares():
    """privacy.md's table of which methods train under DP names every registered method, and says "yes",
    "only with privacy.prototypes: noised" or "refused" as the configuration door does (each method's objective,
    ``Objective.dp_refusal``, through ``train.private.dp_refusals``)."""
    import copy

    from fedhisto.config.study import load_config
    from fedhisto.registries.method_registry import method_names
    from fedhisto.train.private import dp_refusals

    text = (REPO / "docs/privacy.md").read_text()
    section = text.split("## Which methods can train under DP", 1)[1].split("\n## ", 1)[0]
    verdict = {}
    for row in re.findall(r"^\| (.+?) \| (.+?) \|", section, flags=re.M):
        for name in re.split(r",\s*", row[0]):
            verdict[name.strip()] = row[1]
    raw = yaml.safe_load((REPO / "config/config.yaml").read_text())
    raw["train"].update(methods=["fedavg_peft"], ablations=[], engine="sequential")
    base = load_config(raw)
    for name in method_names():
        assert name in verdict, f"privacy.md: no row for method {name}"
        refused = {}
        for protos in ("refuse", "noised"):
            cfg = base.model_copy(update={"privacy": base.privacy.model_copy(update={"enabled": True,
                                                                                    "prototypes": protos})})
            cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"methods": [name]})})
            refused[protos] = bool(dp_refusals(copy.deepcopy(cfg)))
        said = verdict[name]
        expected = ("refused" if refused["noised"] else "only with `privacy.prototypes: noised`" if refused["refuse"]
                    else "yes")
        assert said.strip("*").startswith(expected), f"privacy.md says {name}: {said!r}; the code: {expected}"
