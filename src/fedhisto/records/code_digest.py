"""Which code a pipeline stage runs, as one digest, read from the working tree or from a git commit.

A stage's code is its rule file ``workflow/rules/<stage>.smk``, its script ``scripts/<stage>.py`` and every
module of the package that ``fedhisto.<stage>.stage`` and the script reach by imports, lazy ones included,
and by the ``"fedhisto.module:function"`` strings through which registries name their plugins and scripts
hand work to the warm server (an import walk alone would miss every method, since the method registry
names them by string). :func:`stage_digest` is the SHA-256 of ``path:sha256`` lines over those files, like
:func:`fedhisto.infra.code_identity.source_digest` over the whole package: the same files give the same
digest whether read from a checkout or from a commit's objects, so a recorded digest can be compared with
today's tree to say that a stage's code changed since a number was made.
"""

from __future__ import annotations

import ast
import hashlib
import re
import subprocess
from pathlib import Path

from fedhisto.infra.code_identity import PACKAGE_DIR

REPO_DIR = PACKAGE_DIR.parents[1]  # src/fedhisto -> the checkout
PACKAGE = "src/fedhisto"
_NAMED = re.compile(r"^(fedhisto(?:\.\w+)+)(?::\w+)?$")  # "fedhisto.methods.scaffold:Scaffold"


class CodeReadError(RuntimeError):
    """The code of a commit could not be read (not a checkout, or the commit is not in it)."""


class Tree:
    """Files of the working tree under ``root``."""

    def __init__(self, root: Path = REPO_DIR):
        self.root = Path(root)
        self.label = "working tree"
        self.refs: dict[str, set[str]] = {}  # module -> modules it names (parsed once per tree)
        self._modules: dict[str, str] | None = None

    def modules(self) -> dict[str, str]:
        if self._modules is None:
            self._modules = package_modules(self)
        return self._modules

    def references_of(self, module: str) -> set[str]:
        if module not in self.refs:
            source = self.read(self.modules()[module])
            self.refs[module] = references(source, self.modules()) if source is not None else set()
        return self.refs[module]

    def files(self, folder: str) -> list[str]:
        base = self.root / folder
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts)

    def read(self, path: str) -> bytes | None:
        p = self.root / path
        return p.read_bytes() if p.is_file() else None


class Commit(Tree):
    """Files of ``commit`` in the git repository at ``root`` (read from its objects, not checked out)."""

    def __init__(self, commit: str, root: Path = REPO_DIR):
        super().__init__(root)
        self.commit, self.label = commit, f"commit {commit[:12]}"
        self._cache: dict[str, bytes | None] = {}
        try:
            listing = self._git("ls-tree", "-r", "--name-only", commit, "--", PACKAGE, "scripts", "workflow")
        except (OSError, subprocess.CalledProcessError) as exc:
            raise CodeReadError(f"{root}: cannot list commit {commit} (is it a checkout holding that commit?): "
                                f"{getattr(exc, 'stderr', '') or exc}") from None
        self._listing = sorted(line for line in listing.decode().splitlines() if "__pycache__" not in line)
        self._load(self._listing)

    def _git(self, *args: str, data: bytes | None = None) -> bytes:
        return subprocess.run(["git", *args], cwd=self.root, input=data, capture_output=True, check=True,
                              timeout=120).stdout

    def _load(self, paths: list[str]) -> None:
        """Every listed file in one ``git cat-file --batch``."""
        out = self._git("cat-file", "--batch", data="".join(f"{self.commit}:{p}\n" for p in paths).encode())
        at = 0
        for path in paths:
            header_end = out.index(b"\n", at)
            header = out[at:header_end].split()
            if header[-1] == b"missing":
                self._cache[path], at = None, header_end + 1
                continue
            size = int(header[2])
            self._cache[path] = out[header_end + 1:header_end + 1 + size]
            at = header_end + 1 + size + 1

    def files(self, folder: str) -> list[str]:
        return [p for p in self._listing if p.startswith(folder.rstrip("/") + "/")]

    def read(self, path: str) -> bytes | None:
        return self._cache.get(path)


def package_modules(tree: Tree) -> dict[str, str]:
    """Dotted module name -> file path of every module of the package in ``tree``."""
    out = {}
    for path in tree.files(PACKAGE):
        if path.endswith(".py"):
            parts = Path(path).relative_to("src").with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def references(source: bytes, modules: dict[str, str]) -> set[str]:
    """The package's modules a module's code names: imports at any depth and ``"fedhisto.x:y"`` strings.
    A module imported from a package also brings the package's ``__init__``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedhisto"):
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("fedhisto")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := _NAMED.match(node.value)):
            names = [m.group(1)]
        for name in names:
            parts = name.split(".")
            found |= {".".join(parts[:k]) for k in range(1, len(parts) + 1) if ".".join(parts[:k]) in modules}
    return found


def stage_files(stage: str, tree: Tree) -> list[str]:
    """The files of ``stage``'s code in ``tree``: rule file, script, and the package modules they reach."""
    modules = tree.modules()
    own = [f"workflow/rules/{stage}.smk", f"scripts/{stage}.py"]
    start = {f"fedhisto.{stage}.stage"} & set(modules)
    script = tree.read(f"scripts/{stage}.py")
    if script is not None:
        start |= references(script, modules)
    seen, todo = set(), list(start)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(tree.references_of(name) - seen)
    return sorted({p for p in own if tree.read(p) is not None} | {modules[m] for m in seen})


def stage_hashes(stage: str, tree: Tree) -> dict[str, str]:
    """Path -> SHA-256 of every file of :func:`stage_files`."""
    return {p: hashlib.sha256(tree.read(p) or b"").hexdigest() for p in stage_files(stage, tree)}


def digest_of(hashes: dict[str, str]) -> str:
    """SHA-256 of the sorted ``path:sha256`` lines; ``""`` for no files."""
    if not hashes:
        return ""
    return hashlib.sha256("\n".join(f"{p}:{h}" for p, h in sorted(hashes.items())).encode()).hexdigest()


def stage_digest(stage: str, tree: Tree) -> str:
    """The digest of ``stage``'s code in ``tree`` (:func:`stage_hashes`)."""
    return digest_of(stage_hashes(stage, tree))


def code_at(commit: str | None, root: Path = REPO_DIR) -> Tree:
    """The tree a recorded commit names: its git objects for a clean commit, else (``+dirty``, unknown) the
    working tree as it is now, which is all that is left of an uncommitted state."""
    if commit and commit != "unknown" and not commit.endswith("+dirty"):
        return Commit(commit, root)
    return Tree(root)
