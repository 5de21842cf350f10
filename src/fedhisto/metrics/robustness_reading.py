"""The methods guide's robustness reading, rendered from ``robustness.csv`` (:mod:`fedhisto.metrics.robustness`).

:func:`robustness_reading` returns the Markdown between ``<!-- generated:robustness begin -->`` and
``<!-- generated:robustness end -->`` in docs/methods.md; every number and the verdict on each
stain-aware method come from the rows, so the text cannot drift from the run it reads.
"""

from __future__ import annotations

import csv
from pathlib import Path

from fedhisto.metrics.robustness import FROZEN_METHOD, READING, compare, number, summarize

BLOCK = "robustness"


def read_robustness_csv(path: str | Path) -> list[dict]:
    with Path(path).open(newline="") as fh:
        return list(csv.DictReader(fh))


def _f(v: float | None, sign: bool = False, digits: int = 3) -> str:
    return "n/a" if v is None else (f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}")


def _pm(mean: float | None, sd: float | None, digits: int = 3) -> str:
    return _f(mean, digits=digits) + ("" if sd is None else f" ± {sd:.{digits}f}")


SATURATED = 0.95  # every RI above this: neighbourhoods are by class almost everywhere, RI cannot rank methods


SE_MARGIN = 2.0  # a difference counts when its seed-matched mean exceeds this many standard errors


def better(c: dict, key: str) -> bool:
    """Higher (RI: less site-driven; APD: closer to 0) on average, in most matched seeds, and by more than
    ``SE_MARGIN`` standard errors of the seed-matched differences: a mean a fraction of the seed-to-seed spread
    above the reference is noise, not a finding (with one matched seed there is no spread: never counted)."""
    d = c.get(key)
    if not d or d.get("difference_se") is None:
        return False
    return (d["difference_mean"] > SE_MARGIN * d["difference_se"] and d["difference_mean"] > 0
            and d["higher_in"] > len(d["seeds"]) / 2)


def verdict(c: dict) -> str:
    """One method against the reference, in words, from the seed-matched RI and APD."""
    ri = c["ri"]
    words = (f"`{c['method']}`: RI {_f(ri['method_mean'], digits=4)} vs {_f(ri['reference_mean'], digits=4)} "
             f"(higher in {ri['higher_in']} of {len(ri['seeds'])} matched seeds)")
    if "apd" in c:
        a = c["apd"]
        words += (f", APD {_f(a['method_mean'])} vs {_f(a['reference_mean'])} "
                  f"(closer to 0 in {a['higher_in']} of {len(a['seeds'])})")
    return words


def _methods(names: list[str]) -> str:
    return f" ({', '.join(f'`{m}`' for m in names)})" if names else ""


def robustness_reading(rows: list[dict]) -> str:
    """The generated block's Markdown (without its marker lines)."""
    summary = summarize(rows)
    frozen = next((r for r in rows if r["method"] == FROZEN_METHOD), None)
    if frozen is None:
        raise ValueError("robustness rows without the frozen encoder's row: not a robustness.csv")
    lines = [f"Measured by `croma` on the {frozen['n_images']} internal test images of {frozen['sites']} sites "
             "(`results/metrics/robustness.csv`; RI: higher is less site-driven, 0.5 neutral; APD: closer to 0 "
             "is less prone to a site shortcut):", "",
             "| representation | seeds | RI, mean ± SD over seeds | APD, mean ± SD over seeds |",
             "|---|---|---|---|"]
    for s in summary:
        name = "frozen encoder (every method's start)" if s["encoder_state"] == "frozen" else f"`{s['method']}`"
        n_seeds = len(s["seeds"].split()) if s["seeds"] else "-"
        lines.append(f"| {name} | {n_seeds} | {_pm(s['ri_mean'], s['ri_sd'], 4)} | {_pm(s['apd_mean'], s['apd_sd'])} |")
    comparisons = [c for m in READING["methods"] if (c := compare(rows, m, READING["reference"]))]
    lines += ["", f"Against `{READING['reference']}`, seed for seed:", ""]
    lines += [f"- {verdict(c)}." for c in comparisons] or ["- no stain-aware method shares a seed with it."]
    if not comparisons:
        return "\n".join(lines) + "\n"
    n = len(comparisons)
    by_ri = [c["method"] for c in comparisons if better(c, "ri")]
    by_apd = [c["method"] for c in comparisons if better(c, "apd")]
    ris = [s["ri_mean"] for s in summary if s["ri_mean"] is not None]
    reading = []
    if ris and min(ris) >= SATURATED:
        reading.append(f"RI lies between {min(ris):.3f} and {max(ris):.3f} for every representation, the frozen "
                       "encoder's included: an image's nearest neighbours share its class across sites almost "
                       "everywhere, so on this cohort RI cannot rank the methods.")
    reading.append(f"Counting a difference only when its seed-matched mean exceeds {SE_MARGIN:g} standard errors "
                   f"and most seeds agree: by RI, {len(by_ri)} of {n} stain-aware methods are less "
                   f"site-identifiable than `{READING['reference']}`{_methods(by_ri)}.")
    if any("apd" in c for c in comparisons):
        reading.append(f"By APD, {len(by_apd)} of {n} are less prone to a site shortcut{_methods(by_apd)}: "
                       "a class probe on their representation loses less when its training images tie class "
                       "to site.")
    apds = [s for s in summary if s["encoder_state"] == "adapted" and s["apd_mean"] is not None]
    base = number(frozen.get("apd"))
    if base is not None and apds:
        below = sum(s["apd_mean"] < base for s in apds)
        reading.append(f"The frozen encoder's APD is {base:+.3f}; {below} of {len(apds)} methods' adapted "
                       "representations drop more.")
    lines += ["", "Reading: " + " ".join(reading)]
    return "\n".join(lines) + "\n"


def render(results_dir: str | Path) -> str:
    """The block from a results folder (``metrics/robustness.csv`` under it): the renderer a result-block
    registry calls with a recorded run's folder."""
    return robustness_reading(read_robustness_csv(Path(results_dir) / "metrics" / "robustness.csv"))


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the lines between ``<!-- generated:NAME begin -->`` and ``... end -->`` replaced by ``body``."""
    begin, end = f"<!-- generated:{name} begin -->", f"<!-- generated:{name} end -->"
    head, sep, rest = text.partition(begin + "\n")
    if not sep or end not in rest:
        raise ValueError(f"no {begin} ... {end} block")
    return head + begin + "\n" + body + rest[rest.index(end):]
