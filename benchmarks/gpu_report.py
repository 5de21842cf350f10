"""Writes the Markdown block for docs/changelog.md from what benchmarks/gpu_check.sh left in a folder.

Usage::

    python benchmarks/gpu_report.py OUT            # prints the block and writes OUT/performance_block.md

The tables and the full-grid estimate (39 study runs, at most 50 rounds, one GPU) come from
``fedhisto.bench.gpu_summary``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedhisto.bench.gpu_summary import markdown
from fedhisto.infra.atomic import write_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the folder gpu_check.sh wrote (env.json, bench_*.json, round.json)")
    args = parser.parse_args()
    block = markdown(Path(args.out))
    write_text(Path(args.out) / "performance_block.md", block)
    print(block)


if __name__ == "__main__":
    main()
