"""Regenerate the pinned environments in envs/ from pyproject.toml: `python envs/lock.py` (needs uv).

Each lock is a complete environment for one use, every package pinned with `==` and its hashes, for
CPython 3.11 on Linux x86_64 (the host class the README's figures name); conda.yaml carries cpu.txt's
pins for users who manage environments with conda. cpu-all.txt (every extra but zoo) is resolved first,
with the package's own dependencies held at the newest releases the package alone resolves to; the other
locks keep its pins as constraints (the zoo and CUDA locks all but torch's), so a package two locks share
has one version in both. uv keeps the versions a lock already pins; `--upgrade` re-resolves every lock
to the newest releases the ranges allow.

Python 3.11's venv brings pip 23.2, whose hash-checking mode counts a dependency that another pinned
package asks for with extras (flwr needs ``sqlalchemy[asyncio]``) as unpinned unless the lock also pins it
with those extras: each such package gets a second entry, ``name[extras]==version`` with the same hashes,
found by asking uv for the same resolution with its extras kept (``--no-strip-extras``).

The CPU build of torch (`2.13.0+cpu`) is not on PyPI, which has only the CUDA build of each release: it
comes from `--torch-cpu-from` (a folder or page of wheels: /opt/wheels, where the CI machines keep
it, else PyTorch's CPU wheel page), and its hash is that file's.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path

ENVS = Path(__file__).resolve().parent
REPO = ENVS.parent
TARGET = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28"]
TORCH_CPU_PAGE = "https://download.pytorch.org/whl/cpu/torch/"

# name -> (what it is for, pyproject extras, requirements beside pyproject's, torch build)
LOCKS: dict[str, tuple[str, list[str], list[str], str]] = {
    "cpu-all": ("the package with every extra but zoo, and Flower's Simulation Engine: the Flower proof",
                ["test", "slurm", "federation", "privacy"], ["flwr[simulation]>=1.42,<1.43"], "cpu"),
    "cpu": ("the package on the CPU build of torch: the README's first command", [], [], "cpu"),
    "cpu-test": ("the package and its test extra on the CPU build of torch: the README's test command, "
                 "the SLURM proof and the study rehearsal", ["test"], [], "cpu"),
    "zoo": ("the package, its zoo and test extras, torch 2.14.1 with its torchvision 0.29.1 (a CUDA build "
            "that also runs on the CPU): the encoder zoo proof", ["zoo", "test"], [], "zoo"),
    "cuda": ("the package on PyPI's build of torch 2.13.0 (CUDA): a GPU machine", [], [], "cuda"),
}
TORCH = {"cpu": ["torch==2.13.0"], "cuda": ["torch==2.13.0"], "zoo": ["torch==2.14.1", "torchvision==0.29.1"]}
TORCH_NOTE = {
    "cpu": ("torch 2.13.0+cpu is PyTorch's CPU build, which PyPI does not serve: pip finds it where it is\n"
            "# pointed at it (the CI machines' pip configuration names a folder holding it; elsewhere add\n"
            "# `--extra-index-url https://download.pytorch.org/whl/cpu`). Its hash is that of the file the lock\n"
            "# was made from; that it equals the file on PyTorch's page is not checked from here."),
    "cuda": "torch 2.13.0 is PyPI's build, for CUDA; its NVIDIA libraries are pinned below.",
    "zoo": ("torch 2.14.1 and torchvision 0.29.1 are PyPI's builds (CUDA, about 5.5 GB installed); they run on\n"
            "# the CPU too. No torchvision works beside the CPU build of 2.13.0."),
}


def uv() -> list[str]:
    exe = shutil.which("uv")
    if exe is None:
        sys.exit("uv not found: pip install uv")
    return [exe]


def pins(path: Path, without: tuple[str, ...] = ()) -> list[str]:
    """``name==version`` of every package a lock pins, less the names in ``without``."""
    found = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", path.read_text(), flags=re.M)
    return [f"{n}=={v}" for n, v in found if n.lower() not in without]


def uv_compile(args: list[str], build: str, torch_cpu_from: str, extras: list[str], extra_reqs: list[str],
               constraints: list[str]) -> None:
    """``uv pip compile pyproject.toml`` with the extras, the extra requirements and the torch build's pins,
    under ``constraints`` (``name==version`` or ``name>=version`` lines)."""
    with tempfile.TemporaryDirectory() as tmp:
        reqs, cons = Path(tmp) / "requirements.in", Path(tmp) / "constraints.txt"
        reqs.write_text("\n".join([*extra_reqs, *TORCH[build]]) + "\n")
        cons.write_text("\n".join(constraints) + "\n")
        cmd = [*uv(), "pip", "compile", "pyproject.toml", str(reqs), "-c", str(cons), *TARGET, "--quiet", *args]
        cmd += [a for e in extras for a in ("--extra", e)]
        if build == "cpu":
            cmd += ["--find-links", torch_cpu_from]
        subprocess.run(cmd, cwd=REPO, check=True)


def newest_pipeline_versions(torch_cpu_from: str) -> list[str]:
    """``name>=version`` for each of the package's own dependencies, at the version the package alone
    resolves to. uv settles the widest lock greedily and can fall back to an older release of one of them
    (snakemake 9.16 where 9.27 fits) to keep a newer release of a package deep below; the floors keep the
    pipeline at the newest releases that fit together with every extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    direct = {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in project["dependencies"]}
    with tempfile.TemporaryDirectory() as tmp:
        alone = Path(tmp) / "alone.txt"
        uv_compile(["--no-header", "--no-annotate", "-o", str(alone)], "cpu", torch_cpu_from, [], [], [])
        return [p.replace("==", ">=") for p in pins(alone) if p.split("==")[0].lower() in direct - {"torch"}]


def compile_lock(name: str, constraints: list[str], torch_cpu_from: str, upgrade: bool) -> None:
    purpose, extras, extra_reqs, build = LOCKS[name]
    out = ENVS / f"{name}.txt"
    uv_compile(["--generate-hashes", "--custom-compile-command", "python envs/lock.py", "-o", str(out),
                *(["--upgrade"] if upgrade else [])], build, torch_cpu_from, extras, extra_reqs, constraints)
    head = (textwrap.fill(f"Pinned environment: {purpose}.", 106, initial_indent="# ", subsequent_indent="# ")
            + f"\n# CPython 3.11, Linux x86_64: pip install -r envs/{name}.txt, then pip install -e . (nothing more"
            f" comes).\n# {TORCH_NOTE[build]}\n"
            "# Made by `python envs/lock.py` from pyproject.toml; tests/test_envs.py checks it against it.\n")
    # the requirement and constraint files are temporary ones: name where they come from instead
    text = re.sub(r"(#\s+(via )?)-[rc] /tmp/\S+\.(in|txt)\n", r"\1envs/lock.py\n", out.read_text())
    out.write_text(head + text)
    pin_requested_extras(name, out, torch_cpu_from)


ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) \\\n((?:    --hash=\S+(?: \\)?\n)+)", flags=re.M)


def pin_requested_extras(name: str, out: Path, torch_cpu_from: str) -> None:
    """Give every package the resolution asks for with extras (uv's ``--no-strip-extras`` names them, under the
    lock's own pins) a second entry, ``name[extras]==version`` with the first's hashes."""
    _, extras, extra_reqs, build = LOCKS[name]
    text = out.read_text()
    entries = {m.group(1).lower(): m for m in ENTRY.finditer(text)}
    with tempfile.TemporaryDirectory() as tmp:
        named = Path(tmp) / "extras.txt"
        uv_compile(["--no-strip-extras", "--no-header", "--no-annotate", "-o", str(named)], build, torch_cpu_from,
                   extras, extra_reqs, pins(out))
        asked = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]+\])==(\S+)", named.read_text(), flags=re.M)
    for dist, wanted, version in asked:
        wanted = wanted.replace(" ", "")
        m = entries.get(dist.lower())
        if m is None or m.group(2) != version:
            raise SystemExit(f"envs/lock.py: {dist}{wanted}=={version} asked for, but envs/{name}.txt pins "
                             f"{m.group(0).splitlines()[0] if m else 'no ' + dist}")
        second = (f"{m.group(1)}{wanted}=={version} \\\n{m.group(3)}"
                  "    # via pip 23.2's hash-checking mode (the same files, asked for with these extras)\n")
        after = re.compile(re.escape(m.group(0)) + r"(?:    #.*\n)*").search(text).end()  # past its "# via" lines
        text = text[:after] + second + text[after:]
    out.write_text(text)


def write_conda(lock: Path) -> None:
    lines = ["# Made by `python envs/lock.py` from envs/cpu.txt: the same pins, for conda users:",
             "#   conda env create -f envs/conda.yaml && conda activate fedhisto && pip install -e .",
             "# Python comes from conda, every package from pip (torch's CPU build from PyTorch's page).",
             "name: fedhisto", "channels:", "  - conda-forge", "dependencies:", "  - python=3.11", "  - pip",
             "  - pip:", "      - --extra-index-url https://download.pytorch.org/whl/cpu"]
    lines += [f"      - {pin}" for pin in pins(lock)]
    (ENVS / "conda.yaml").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upgrade", action="store_true", help="re-resolve to the newest allowed releases")
    default = "/opt/wheels" if Path("/opt/wheels").is_dir() else TORCH_CPU_PAGE
    parser.add_argument("--torch-cpu-from", default=default, help=f"where torch's CPU wheel lies (default {default})")
    args = parser.parse_args(argv)
    # cpu-all.txt first, the widest CPU lock, so that every package has one version in every lock
    compile_lock("cpu-all", newest_pipeline_versions(args.torch_cpu_from) if args.upgrade or not
                 (ENVS / "cpu-all.txt").exists() else [], args.torch_cpu_from, args.upgrade)
    for name in ("cpu", "cpu-test"):
        compile_lock(name, pins(ENVS / "cpu-all.txt"), args.torch_cpu_from, False)
    for name in ("zoo", "cuda"):  # the same, but for the torch build
        compile_lock(name, pins(ENVS / "cpu-all.txt", without=("torch",)), args.torch_cpu_from, False)
    write_conda(ENVS / "cpu.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
