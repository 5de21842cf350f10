"""Renderers of the main pipeline's result blocks (Tables 4-8), from the report's and accounting's CSV files.

Each takes a results folder (a pipeline's ``results/`` or a record under ``benchmarks/records/``) and returns
markdown. The tables keep the columns a reader compares methods by; the full files carry every column. A
method that departs from its paper's assumptions (the report's ``caveat`` column) is marked with a dagger
and its departure printed once under the table.
"""

from __future__ import annotations

import csv
from pathlib import Path


class EmptyTable(ValueError):
    """A result file with a header and no rows (e.g. Table 7 of a run configured without ablations)."""


def read_rows(results: Path, name: str) -> list[dict[str, str]]:
    path = Path(results) / name
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        raise EmptyTable(f"`{name}` has no rows in this run")
    return rows


def num(value: str | float | None, digits: int = 3, sign: bool = False) -> str:
    """A number at ``digits`` decimals (``+`` shown with ``sign``); empty or missing as "-"."""
    if value in (None, ""):
        return "-"
    x = float(value)
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def with_ci(row: dict, key: str, digits: int = 3, sign: bool = False, low: str = "_ci_low",
            high: str = "_ci_high") -> str:
    """``estimate [low, high]`` of ``key`` in a row with ``key``, ``key_ci_low`` and ``key_ci_high``."""
    return (f"{num(row[key], digits, sign)} [{num(row[key + low], digits, sign)}, "
            f"{num(row[key + high], digits, sign)}]")


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def with_caveats(rows: list[dict], table: str, key: str = "method") -> tuple[dict[str, str], str]:
    """(row key -> its name with a dagger when the row has a caveat, the caveat lines to print under
    ``table``)."""
    caveats = {r[key]: r["caveat"] for r in rows if r.get("caveat")}
    names = {r[key]: r[key] + (" †" if r[key] in caveats else "") for r in rows}
    notes = "".join(f"\n\n† {text}" for text in dict.fromkeys(caveats.values()))
    return names, table + notes


def table4(results: Path) -> str:
    """Internal global test: macro-F1 mean and SD over finalised seeds, worst client, ECE."""
    rows = read_rows(results, "tables/table4_internal.csv")
    names, _ = with_caveats(rows, "")
    body = [[names[r["method"]], r["finalised_seeds"], num(r["macro_f1_mean"], 4), num(r["macro_f1_sd"], 4),
             f"{num(r['worst_client_macro_f1_mean'], 2)} ({num(r['worst_client_macro_f1_sd'], 2)})",
             num(r["ece_mean"])] for r in rows]
    table = md_table(["method", "seeds", "macro-F1 mean", "SD", "worst client (SD)", "ECE"], body)
    failed = [f"{r['method']} {r['failed_seeds']}" for r in rows if r.get("failed_seeds")]
    missed = [f"{r['method']} {r['unavailable_client_rounds']}" for r in rows
              if r.get("unavailable_client_rounds") not in (None, "", "0")]
    table += (f"\n\nFailed seeds: {', '.join(failed) or 'none'}; unavailable client-rounds: "
              f"{', '.join(missed) or 'none'}.")
    return with_caveats(rows, table)[1]


def table5(results: Path) -> str:
    """External cohort, each method's seed ensemble."""
    rows = read_rows(results, "tables/table5_external.csv")
    names, _ = with_caveats(rows, "")
    body = [[names[r["method"]], num(r["macro_f1"], 4), num(r["balanced_accuracy"], 4),
             *(num(r[f"recall_{c}"]) for c in ("ACA", "Normal", "SCC")), num(r["nll"]), num(r["ece"])] for r in rows]
    table = md_table(["method", "macro-F1", "balanced acc.", "recall ACA", "recall Normal", "recall SCC", "NLL", "ECE"],
                     body)
    return with_caveats(rows, table)[1]


def _comparisons(results: Path, name: str) -> str:
    rows = [r for r in read_rows(results, name) if r["metric"] == "macro_f1"]
    caveats = {r["comparison"]: r["caveat"] for r in rows if r.get("caveat")}
    units = {r["unit"] for r in rows}
    body = [[r["comparison"] + (" †" if r["comparison"] in caveats else ""), r["method_seeds"],
             *([r["unit"]] if units != {"image"} else []), num(r["difference"], 4, sign=True),
             f"[{num(r['ci_low'], 4, sign=True)}, {num(r['ci_high'], 4, sign=True)}]",
             p_value(r["p_two_sided"]), r["n_resamples"]] for r in rows]
    header = ["comparison", "seeds (both arms)", *(["unit"] if units != {"image"} else []), "difference",
              "95 % CI", "p", "resamples"]
    table = md_table(header, body)
    return table + "".join(f"\n\n† {text}" for text in dict.fromkeys(caveats.values()))


def p_value(text: str) -> str:
    """The report's p: a number at three decimals, or its ``< bound`` kept as written."""
    return text if text.startswith("<") else f"{float(text):.3f}"


def table6(results: Path) -> str:
    """Paired bootstrap of external macro-F1, v2 minus each reference, matched seeds."""
    return _comparisons(results, "tables/table6_bootstrap.csv")


def table7(results: Path) -> str:
    """Ablations: v2 minus each ablated v2, external macro-F1, the ablation seeds."""
    return _comparisons(results, "tables/table7_ablation.csv")


def table8(results: Path) -> str:
    """Parameters and traffic per round, counted from the real tensors."""
    rows = read_rows(results, "accounting/communication.csv")
    body = [[r["method"], r["trainable_parameters"], num(r["per_round_mib"]), num(r["overhead_vs_fedavg_pct"], 1)]
            for r in rows]
    encoders = sorted({r["encoder"] for r in rows})
    return (f"Encoder {', '.join(encoders)}, {rows[0]['clients']} clients.\n\n"
            + md_table(["method", "trainable parameters", "per round (MiB)", "vs FedAvg-PEFT (%)"], body))


#: The LoRA aggregators' methods, in the order the aggregators' guide lists them.
AGGREGATOR_METHODS = {"fedavg_peft": "delta_svd", "factor_mean": "factor_mean", "flexlora": "flexlora",
                      "fedex_lora": "fedex_lora", "ffa_lora": "ffa_lora", "fedsa_lora": "fedsa_lora"}


def aggregator_traffic(results: Path) -> str:
    """Table 8's traffic of the LoRA aggregators' methods (delta-SVD is FedAvg-PEFT's)."""
    rows = {r["method"]: r for r in read_rows(results, "accounting/communication.csv")}
    body = [[f"`{agg}` ({method})", num(rows[method]["per_round_mib"]),
             f"{float(rows[method]['per_round_mib']) / float(rows['fedavg_peft']['per_round_mib']):.2f}x"]
            for method, agg in AGGREGATOR_METHODS.items() if method in rows]
    encoder = next(iter(rows.values()))["encoder"]
    return (f"Encoder {encoder} (the run's), {next(iter(rows.values()))['clients']} clients.\n\n"
            + md_table(["aggregator (method)", "per round (MiB)", "vs delta-SVD"], body))
