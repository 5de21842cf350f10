"""Which code a process runs, so a federation can refuse a site (or a coordinator) on other code.

:func:`code_identity` returns the package version, the git commit of the source tree when the package
runs from a git checkout (``+dirty`` with local changes, else ``None``) and, always, a SHA-256
digest of the package's own files (every ``*.py`` plus the package data, ``__pycache__`` excluded).
The digest is what two parties compare: it is the same for a git checkout, an editable install and a
wheel built from the same tree, whereas a commit exists only in a checkout and a version string
changes only on release. A tree with uncommitted edits to the package has the commit ``...+dirty``
and a digest that differs from the clean commit's, so it is refused too.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from fedhisto import __version__

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the fedhisto package (this module sits in infra/)
#: Files of the package that are not Python source but change what it does (pyproject package-data).
PACKAGE_DATA = ("py.typed", "federation/app/pyproject.toml", "federation/fastpath/app/pyproject.toml")


class CodeMismatch(RuntimeError):
    """A party runs other code than the coordinator; the message names the party and what differs."""


def package_files(root: Path = PACKAGE_DIR) -> list[Path]:
    """The files the digest covers, sorted by their path relative to ``root``."""
    files = [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    files += [root / name for name in PACKAGE_DATA if (root / name).is_file()]
    return sorted(set(files), key=lambda p: p.relative_to(root).as_posix())


def source_digest(root: Path = PACKAGE_DIR) -> str:
    """SHA-256 over ``relative/path:sha256-of-content`` lines of :func:`package_files`."""
    lines = [f"{p.relative_to(root).as_posix()}:{hashlib.sha256(p.read_bytes()).hexdigest()}"
             for p in package_files(root)]
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


def _git_commit(root: Path) -> str | None:
    """The checkout's commit, or None when the package is not inside a git work tree (a wheel)."""
    from fedhisto.infra.provenance import git_commit

    if root != PACKAGE_DIR:  # provenance.git_commit is about this package's own tree only
        return None
    commit = git_commit()
    return None if commit == "unknown" else commit


@lru_cache(maxsize=1)
def code_identity() -> dict[str, str | None]:
    """``{"package_version", "git_commit" (None outside a checkout), "source_digest"}`` of this process."""
    return {"package_version": __version__, "git_commit": _git_commit(PACKAGE_DIR),
            "source_digest": source_digest(PACKAGE_DIR)}


def check_code(party: str, theirs: object, ours: dict | None = None) -> None:
    """Raise :class:`CodeMismatch` naming ``party`` unless ``theirs`` is a code identity with our digest.

    The digest decides; version and commit are reported to say what the other side runs (a site on
    a wheel has no commit, which is no reason to refuse it)."""
    ours = ours or code_identity()
    if not isinstance(theirs, dict) or not isinstance(theirs.get("source_digest"), str):
        raise CodeMismatch(f"{party}: no code identity (expected package_version, git_commit, source_digest); "
                           f"got {theirs!r:.200}")
    if theirs["source_digest"] != ours["source_digest"]:
        raise CodeMismatch(
            f"{party} runs other code: source digest {theirs['source_digest'][:16]}... (version "
            f"{theirs.get('package_version')}, commit {theirs.get('git_commit')}) vs the coordinator's "
            f"{ours['source_digest'][:16]}... (version {ours['package_version']}, commit {ours['git_commit']}); "
            "install the coordinator's release on that site")


def identity_strings(ident: dict | None = None) -> dict[str, str]:
    """The identity with every value a string (no commit -> ""), as a Flower ConfigRecord carries it in
    the handshake; :func:`check_code` accepts it unchanged."""
    ident = ident or code_identity()
    return {k: "" if v is None else str(v) for k, v in ident.items()}
