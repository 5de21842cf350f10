"""The methods guide's robustness reading, rendered from ``robustness.csv`` (:mod:`fedhisto.metrics.robustness`).

:func:`robustness_reading` returns the Markdown between ``<!-- generated:robustness begin -->`` and
``<!-- generated:robustness end -->`` in docs/methods.md; every number and the verdict on each
stain-aware method come from the rows, so the text cannot drift from the run it reads.
"""

from __future__ import annotations

import csv
from pathlib import Path

from fedhisto.metrics.robustness import FROZEN_METHOD, READING, compare, summarize

BLOCK = "robustness"


def read_robustness_csv(path: str | Path) -> list[dict]:
    with Path(path).open(newline="") as fh:
        return list(csv.DictReader(fh))


def _f(v: float | None, sign: bool = False) -> str:
    return "n/a" if v is None else (f"{v:+.3f}" if sign else f"{v:.3f}")


def _pm(mean: float | None, sd: float | None) -> str:
    return _f(mean) + ("" if sd is None else f" ± {sd:.3f}")


def verdict(c: dict) -> str:
    """One method against the reference, in words, from the seed-matched RI (and APD where measured)."""
    ri = c["ri"]
    n = len(ri["seeds"])
    lower = ri["difference_mean"] > 0 and ri["higher_in"] > n / 2
    words = (f"`{c['method']}` RI {_f(ri['method_mean'])} vs {_f(ri['reference_mean'])} "
             f"({_f(ri['difference_mean'], sign=True)}, higher in {ri['higher_in']} of {n} matched seeds)")
    if "apd" in c:
        a = c["apd"]
        words += (f", APD {_f(a['method_mean'])} vs {_f(a['reference_mean'])} "
                  f"(closer to 0 in {a['higher_in']} of {len(a['seeds'])})")
    return words + (": less site-identifiable" if lower else ": not less site-identifiable")


def robustness_reading(rows: list[dict]) -> str:
    """The generated block's Markdown (without its marker lines)."""
    summary = summarize(rows)
    frozen = next((r for r in rows if r["method"] == FROZEN_METHOD), None)
    if frozen is None:
        raise ValueError("robustness rows without the frozen encoder's row: not a robustness.csv")
    lines = [f"Measured by `croma` on the {frozen['n_images']} internal test images of {frozen['sites']} sites "
             "(`results/metrics/robustness.csv`; RI: higher is less site-driven, 0.5 neutral; APD: closer to 0 "
             "is more robust):", "",
             "| representation | seeds | RI, mean ± SD over seeds | APD, mean ± SD over seeds |",
             "|---|---|---|---|"]
    for s in summary:
        name = "frozen encoder (every method's start)" if s["encoder_state"] == "frozen" else f"`{s['method']}`"
        n_seeds = len(s["seeds"].split()) if s["seeds"] else "-"
        lines.append(f"| {name} | {n_seeds} | {_pm(s['ri_mean'], s['ri_sd'])} | {_pm(s['apd_mean'], s['apd_sd'])} |")
    comparisons = [c for m in READING["methods"] if (c := compare(rows, m, READING["reference"]))]
    lines += ["", f"Against `{READING['reference']}`, seed for seed:", ""]
    lines += [f"- {verdict(c)}." for c in comparisons] or ["- no stain-aware method shares a seed with it."]
    lowered = [c["method"] for c in comparisons if c["ri"]["difference_mean"] > 0
               and c["ri"]["higher_in"] > len(c["ri"]["seeds"]) / 2]
    if comparisons:
        verdict_line = ("all three" if len(lowered) == len(comparisons) == 3 else
                        f"{len(lowered)} of {len(comparisons)}")
        lines += ["", f"Reading: {verdict_line} stain-aware method(s) lower site identifiability against "
                      f"`{READING['reference']}` on this cohort"
                      + (f" ({', '.join(f'`{m}`' for m in lowered)})." if lowered else ".")]
    return "\n".join(lines) + "\n"


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the lines between ``<!-- generated:NAME begin -->`` and ``... end -->`` replaced by ``body``."""
    begin, end = f"<!-- generated:{name} begin -->", f"<!-- generated:{name} end -->"
    head, sep, rest = text.partition(begin + "\n")
    if not sep or end not in rest:
        raise ValueError(f"no {begin} ... {end} block")
    return head + begin + "\n" + body + rest[rest.index(end):]
