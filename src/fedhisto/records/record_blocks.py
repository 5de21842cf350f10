"""``fedhisto records``: the guides' result blocks, generated from a recorded run, never typed.

Two steps, one command:

1. **Record** (``fedhisto records RESULTS``): for every registered result block
   (:mod:`fedhisto.registries.record_registry`) whose input files the results folder holds, copy them, with
   their provenance sidecars, into ``benchmarks/records/<run>/`` (same relative paths), and write
   ``records.json`` there: per block, the commits that made its numbers, the day they were made, the host
   (CPU model and the SIMD level torch dispatched to, from the training runs' ``report.json``) and the code
   digest of every stage behind it, taken from the commit that stage's outputs name
   (:mod:`fedhisto.records.code_digest`). The record replaces the run's previous one.
2. **Render** (``fedhisto records``, also after step 1): write every block into every guide holding
   ``<!-- generated:NAME begin -->`` .. ``<!-- generated:NAME end -->``: a stamp line, a line saying that
   the code of its stages has changed since (when today's digest of a stage differs from the recorded
   one), then the renderer's markdown. A block without a record says so. ``--check`` writes nothing and
   fails when a guide's block differs from what would be written.

A block registered with a committed ``record`` (a JSON file its own command writes, such as the reference
tests' differences) skips step 1: step 2 renders it from that file, stamped with the file, the command that
writes it and, where the record states them, its commit, day and host.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

from fedhisto.infra.atomic import write_bytes, write_json, write_text
from fedhisto.infra.provenance import SIDECAR_SUFFIX
from fedhisto.records.code_digest import REPO_DIR, Tree, code_at, digest_of, stage_hashes
from fedhisto.records.tables import EmptyTable
from fedhisto.registries.record_registry import RECORDS, RecordEntry

RECORDS_DIR = Path("benchmarks/records")
STAMP_FILE = "records.json"
BLOCK = re.compile(r"(<!-- generated:([a-z0-9_]+) begin -->\n)(.*?)(<!-- generated:\2 end -->)", re.S)


class RecordError(RuntimeError):
    """A results folder or record that cannot be used; the message names the file and what is wrong."""


def guide_paths(root: Path = REPO_DIR) -> list[Path]:
    """The README and every page under docs/ (the changelog included: a block may be shown anywhere)."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


# ------------------------------------------------------------------ step 1: record a results folder
def _provenance_of(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if path.name.endswith(SIDECAR_SUFFIX):
        return doc if isinstance(doc, dict) else None
    prov = doc.get("provenance") if isinstance(doc, dict) else None
    return prov if isinstance(prov, dict) else None


def stage_commits(results: Path) -> dict[str, set[str]]:
    """Stage -> every git commit its outputs under ``results`` name (sidecars and embedded blocks)."""
    out: dict[str, set[str]] = defaultdict(set)
    for path in results.rglob("*.json"):
        prov = _provenance_of(path)
        if prov and prov.get("stage") and prov.get("git_commit"):
            out[prov["stage"]].add(prov["git_commit"])
    return out


def summary_of(path: Path) -> Path:
    """Where a file without a sidecar has its provenance: a JSON report embeds it (``"provenance"``), and an
    experiment's CSV tables share the block of the experiment's summary, ``<folder>/<folder name>.json``."""
    return path if path.suffix == ".json" else path.parent / f"{path.parent.name}.json"


def hosts(results: Path) -> list[str]:
    """``CPU model (SIMD level)`` of the machines the training runs record in their runtime block."""
    found = set()
    for report in results.glob("train/*/seed*/report.json"):
        runtime = json.loads(report.read_text()).get("runtime") or {}
        if runtime.get("cpu"):
            found.add(f"{runtime['cpu']} ({runtime.get('cpu_capability') or 'unknown SIMD'})"
                      + (f", GPU {runtime['gpu']}" if runtime.get("gpu") else ""))
    return sorted(found)


def _stamp(entry: RecordEntry, results: Path, commits: dict[str, set[str]], host: list[str],
           trees: dict[str | None, Tree], files: dict[str, dict[str, str]]) -> dict:
    made, block_commits = [], set()
    for rel in entry.inputs:
        prov = _provenance_of(results / (rel + SIDECAR_SUFFIX))
        if prov is None:
            prov = _provenance_of(summary_of(results / rel))
        if not prov:
            raise RecordError(f"{results / rel}: no provenance sidecar ({rel}{SIDECAR_SUFFIX}) and no "
                              f"{summary_of(results / rel).name} with a provenance block beside it; it was not "
                              "written by a pipeline stage")
        made.append(prov.get("created_utc", ""))
        block_commits.add(prov.get("git_commit", "unknown"))
    stages: dict[str, dict[str, str]] = {}
    for stage in entry.stages:
        for commit in sorted(commits.get(stage, {None})):
            if commit not in trees:
                trees[commit] = code_at(commit)
            hashes = stage_hashes(stage, trees[commit])
            files.setdefault(commit or "unknown", {}).update(hashes)
            stages.setdefault(stage, {})[commit or "unknown"] = digest_of(hashes)
    return {"run": entry.run, "inputs": list(entry.inputs), "commits": sorted(block_commits),
            "made_utc": max(made), "hosts": host, "stages": stages}


def record(results: str | Path, run: str = "default", root: Path = REPO_DIR) -> dict[str, dict]:
    """Copy the inputs of every block of ``run`` that ``results`` holds into ``root/benchmarks/records/<run>/``
    and write its ``records.json``; returns the stamps by block name. The stage digests are read from this
    checkout's git objects at the commits the results name."""
    results = Path(results)
    if not results.is_dir():
        raise RecordError(f"{results}: no results folder")
    entries = [e for e in RECORDS.values() if e.run == run and e.record is None and not e.from_code]
    present = [e for e in entries if all((results / rel).is_file() for rel in e.inputs)]
    if not present:
        raise RecordError(f"{results}: holds the inputs of no result block of run {run!r} "
                          f"(e.g. {entries[0].inputs[0] if entries else '-'}); run the pipeline first")
    commits, host, trees, files = stage_commits(results), hosts(results), {}, {}
    stamps = {e.name: _stamp(e, results, commits, host, trees, files) for e in present}
    out = root / RECORDS_DIR / run
    staging = out.with_name(f".{run}.new")
    shutil.rmtree(staging, ignore_errors=True)
    for e in present:
        for rel in e.inputs:
            for src in (results / rel, results / (rel + SIDECAR_SUFFIX)):
                if src.is_file():
                    (staging / src.relative_to(results)).parent.mkdir(parents=True, exist_ok=True)
                    write_bytes(staging / src.relative_to(results), src.read_bytes())
            if not (results / (rel + SIDECAR_SUFFIX)).is_file():  # its provenance is its summary's block
                summary = summary_of(results / rel)
                block = _provenance_of(summary)
                write_json(staging / (rel + ".provenance.json"),
                           {"provenance_of": summary.relative_to(results).as_posix(), "provenance": block})
    # each commit's file hashes, so a stale block can name the files that changed since
    write_json(staging / STAMP_FILE, {"run": run, "blocks": stamps, "code": files})
    old = out.with_name(f".{run}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    staging.rename(out)  # the record is replaced whole: complete or absent, never two runs mixed
    shutil.rmtree(old, ignore_errors=True)
    return stamps


# ------------------------------------------------------------------ step 2: render the blocks
def _short(commit: str) -> str:
    return commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")


def stale(stamp: dict, code: dict[str, dict[str, str]], today: Tree,
          cache: dict[str, dict[str, str]] | None = None) -> tuple[list[str], list[str]]:
    """(the stages of a block whose code in ``today``'s tree differs from the recorded code, the files that
    differ: changed or added in a stage's code, or gone from the tree), from the record's file hashes
    ``code`` (per commit, the union of the recorded stages' files)."""
    cache = {} if cache is None else cache
    stages, files = [], set()
    for stage, digests in stamp["stages"].items():
        if stage not in cache:
            cache[stage] = stage_hashes(stage, today)
        now = cache[stage]
        for commit, digest in digests.items():
            if digest != digest_of(now):
                then = code.get(commit, {})
                files |= {p for p, h in now.items() if then.get(p) != h}
                files |= {p for p in then if p not in now and today.read(p) is None}
                stages.append(stage)
                break
    return stages, sorted(files)


def render_block(name: str, root: Path = REPO_DIR, today: Tree | None = None,
                 cache: dict[str, str] | None = None) -> str:
    """The body of block ``name`` from the record under ``root``: stamp, staleness line if any (against
    ``today``, by default this checkout's working tree), the renderer's markdown."""
    if name not in RECORDS:
        raise RecordError(f"no result block {name!r} is registered (fedhisto.registries.record_registry)")
    entry = RECORDS[name]
    if entry.from_code:
        return entry.renderer()()
    if entry.record is not None:
        return render_committed(entry, root)
    folder = root / RECORDS_DIR / entry.run
    doc = json.loads((folder / STAMP_FILE).read_text()) if (folder / STAMP_FILE).is_file() else {}
    stamps = doc.get("blocks", {})
    if name not in stamps:
        return (f"*Not recorded yet: run the pipeline, then `fedhisto records RESULTS` (block `{name}`, "
                f"record `{RECORDS_DIR / entry.run}`).*\n")
    stamp = stamps[name]
    digest = stage_digest_line(stamp)
    head = (f"*Generated by `fedhisto records` from `{RECORDS_DIR / entry.run}`: commit "
            f"{', '.join(map(_short, stamp['commits']))}, made {stamp['made_utc'][:10]}, on "
            f"{'; '.join(stamp['hosts']) or 'an unrecorded host'}; stage code {digest}.*\n")
    changed, files = stale(stamp, doc.get("code", {}), today or Tree(REPO_DIR), cache)
    if changed:
        named = ", ".join(f"`{f}`" for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        head += (f"\n**Stale:** the code of stage{'s' if len(changed) > 1 else ''} {', '.join(changed)} has changed "
                 f"since these numbers were made ({named}); rerun the pipeline and `fedhisto records` to refresh "
                 "them.\n")
    try:
        body = entry.renderer()(folder).strip()
    except EmptyTable as exc:  # nothing to tabulate is a statement, not an error
        body = f"*Nothing to show: {exc}.*"
    return head + "\n" + body + "\n"


def render_committed(entry: RecordEntry, root: Path = REPO_DIR) -> str:
    """The body of a block rendered from a committed JSON record: the record's stamp (file, the command that
    writes it, and its ``commit``, ``made_utc`` and ``host`` where it has them), then the renderer's markdown;
    the entry's ``pending`` sentence while the record does not exist."""
    path = root / entry.record
    if not path.is_file():
        return (entry.pending or f"**Pending:** not recorded yet: `{entry.made_by}` writes `{entry.record}`, "
                                 "then `fedhisto records` writes this block.") + "\n"
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise RecordError(f"{path}: not JSON ({exc}); rewrite it with `{entry.made_by}`") from None
    made = [f"commit {_short(doc['commit'])}" if doc.get("commit") else "",
            f"made {doc['made_utc'][:10]}" if doc.get("made_utc") else "", f"on {doc['host']}" if doc.get("host") else ""]
    made = ", ".join(m for m in made if m)
    head = (f"*Generated by `fedhisto records` from `{entry.record}`, written by `{entry.made_by}`"
            f"{': ' + made if made else ''}.*\n")
    try:
        body = entry.renderer()(doc).strip()
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"{path}: cannot render block {entry.name!r} from it ({type(exc).__name__}: {exc}); "
                          f"rewrite it with `{entry.made_by}`") from None
    return head + "\n" + body + "\n"


def stage_digest_line(stamp: dict) -> str:
    """One short digest over the block's recorded stage digests (the full ones are in records.json)."""
    import hashlib

    text = json.dumps(stamp["stages"], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def rendered_guides(root: Path = REPO_DIR, only: set[str] | None = None) -> dict[Path, str]:
    """Every guide holding a generated block -> its text with every block (or those named in ``only``)
    rendered afresh."""
    today, cache, bodies, out = Tree(REPO_DIR), {}, {}, {}
    for path in guide_paths(root):
        text = path.read_text()
        if not BLOCK.search(text):
            continue

        def fill(m: re.Match) -> str:
            name = m.group(2)
            if only is not None and name not in only:
                return m.group(0)
            if name not in bodies:
                bodies[name] = render_block(name, root, today, cache)
            return m.group(1) + bodies[name] + m.group(4)

        out[path] = BLOCK.sub(fill, text)
    return out


def differing_blocks(root: Path = REPO_DIR) -> list[str]:
    """``guide: block`` of every generated block whose committed text is not what would be written."""
    found = []
    for path, new in rendered_guides(root).items():
        old_blocks = {m.group(2): m.group(3) for m in BLOCK.finditer(path.read_text())}
        new_blocks = {m.group(2): m.group(3) for m in BLOCK.finditer(new)}
        found += [f"{path.relative_to(root)}: {n}" for n in old_blocks if old_blocks[n] != new_blocks[n]]
    return found


def write_guides(root: Path = REPO_DIR, only: set[str] | None = None) -> list[Path]:
    """Write every guide whose blocks (or those named in ``only``) differ from their rendering; the paths."""
    written = []
    for path, new in rendered_guides(root, only).items():
        if new != path.read_text():
            write_text(path, new)
            written.append(path)
    return written


# ------------------------------------------------------------------ the command
def add_parser(sub) -> None:
    p = sub.add_parser("records", help="write every result block of the guides from a recorded run (or record a "
                                       "results folder first); --check only compares")
    p.add_argument("results", nargs="?", help="a pipeline's results folder to record first (after `snakemake all` "
                                              "and, for the experiments' blocks, `snakemake experiments`)")
    p.add_argument("--run", default="default", help="the record's name under benchmarks/records/ (default: default)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a guide's block differs")
    p.set_defaults(func=_cmd_records)


def _cmd_records(args: argparse.Namespace) -> int:
    import sys

    if not (REPO_DIR / ".git").exists() or not (REPO_DIR / "docs").is_dir():
        raise RecordError(f"{REPO_DIR}: not a checkout of the repository; run `fedhisto records` from one")
    if args.results:
        if args.check:
            raise RecordError("--check compares the guides with the committed records; it records nothing")
        stamps = record(args.results, args.run)
        print(f"recorded {len(stamps)} blocks of run {args.run!r} from {args.results}: {', '.join(stamps)}")
    if args.check:
        differ = differing_blocks()
        for line in differ:
            print(f"differs: {line}", file=sys.stderr)
        return 1 if differ else 0
    for path in write_guides():
        print(f"wrote {path.relative_to(REPO_DIR)}")
    return 0


