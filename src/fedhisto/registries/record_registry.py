"""The record registry: one line per result block of the guides, below, naming its renderer as ``"module:function"``.

A result block shows numbers that a run or a measurement made. Two kinds:

- **From a pipeline run** (Tables 4-8 of the embedded default, an experiment's table): the renderer is
  ``render(results_dir) -> markdown`` reading the files it declares (``inputs``, paths relative to a results
  folder); ``stages`` are the pipeline stages whose code made those numbers, so the block can say when that
  code has changed since. ``fedhisto records RESULTS`` copies every declared input (with its provenance
  sidecar) from a results folder into ``benchmarks/records/<run>/``, where the renderers read them from then on.
- **From a committed record** that a command of its own writes (``record``, a JSON file in the repository,
  and ``made_by``, the command that writes it: the reference tests' differences, the first command's timing):
  the renderer is ``render(record: dict) -> markdown``. No results folder is involved; until the command has
  written the record, the block says so (``pending``).
- **From the code** (``from_code``: a table the registries themselves make, such as what the coordinator
  learns under secure aggregation): the renderer is ``render() -> markdown``; the block is exactly its output.

``fedhisto records`` writes every block of both kinds into every guide that holds
``<!-- generated:NAME begin -->`` ... ``<!-- generated:NAME end -->`` (:mod:`fedhisto.records`). A plugin's
table is one renderer function and one line here.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class RecordEntry:
    name: str
    target: str  # "package.module:function": function(results_dir: Path) -> str, or function(record: dict) -> str
    inputs: tuple[str, ...] = ()  # files relative to a results folder, copied into the record
    stages: tuple[str, ...] = ()  # pipeline stages whose code made the numbers
    run: str = "default"  # benchmarks/records/<run>/
    record: str | None = None  # a committed JSON record, relative to the repository (instead of inputs)
    made_by: str = ""  # the command that writes ``record``
    pending: str = ""  # what the block says until ``record`` exists
    from_code: bool = False  # rendered from the code alone: function() -> str

    def renderer(self) -> Callable[[Any], str]:
        module, _, function = self.target.partition(":")
        return getattr(importlib.import_module(module), function)


RECORDS: dict[str, RecordEntry] = {}


def register(name: str, target: str, *, inputs: tuple[str, ...] | list[str] = (),
             stages: tuple[str, ...] | list[str] = (), run: str = "default", record: str | None = None,
             made_by: str = "", pending: str = "", from_code: bool = False, replace: bool = False) -> RecordEntry:
    """Add a result block ``name`` rendered by ``target``: from ``inputs`` (relative to a results folder), or
    from the committed JSON ``record`` (relative to the repository) that the command ``made_by`` writes."""
    if not _NAME.match(name):
        raise ValueError(f"record name {name!r} must be lower-case letters, digits and underscores")
    if name in RECORDS and not replace:
        raise ValueError(f"record {name!r} is registered already ({RECORDS[name].target}); pass replace=True")
    if ":" not in target:
        raise ValueError(f"record {name!r}: target {target!r} is not 'module:function'")
    if from_code:
        if inputs or stages or record is not None:
            raise ValueError(f"record {name!r}: a block rendered from the code takes no inputs, stages or record")
    elif record is not None:
        if inputs or stages:
            raise ValueError(f"record {name!r}: a committed record ({record}) takes no inputs or stages")
        if Path(record).is_absolute() or ".." in Path(record).parts or not record.endswith(".json"):
            raise ValueError(f"record {name!r}: record must be a .json path inside the repository, got {record!r}")
        if not made_by:
            raise ValueError(f"record {name!r}: name the command that writes {record} (made_by)")
    elif not inputs or any(Path(p).is_absolute() or ".." in Path(p).parts for p in inputs):
        raise ValueError(f"record {name!r}: inputs must be paths inside a results folder, got {list(inputs)}")
    RECORDS[name] = entry = RecordEntry(name, target, tuple(inputs), tuple(stages), run, record, made_by, pending,
                                        from_code)
    return entry


# ------------------------------------------------------------------ built-in result blocks
#: The stages behind a trained, predicted and scored run of the main pipeline.
TRAINED = ("cohort", "clearance", "manifest", "stain", "pretrain", "train", "predict", "metrics")
EXPERIMENTS = (*TRAINED, "experiments")

register("table4_internal", "fedhisto.records.tables:table4", inputs=["tables/table4_internal.csv"],
         stages=[*TRAINED, "report"])
register("table5_external", "fedhisto.records.tables:table5", inputs=["tables/table5_external.csv"],
         stages=[*TRAINED, "report"])
register("table6_bootstrap", "fedhisto.records.tables:table6", inputs=["tables/table6_bootstrap.csv"],
         stages=[*TRAINED, "bootstrap", "report"])
register("table7_ablation", "fedhisto.records.tables:table7", inputs=["tables/table7_ablation.csv"],
         stages=[*TRAINED, "bootstrap", "report"])
register("table8_communication", "fedhisto.records.tables:table8", inputs=["accounting/communication.csv"],
         stages=["accounting"])
register("aggregator_traffic", "fedhisto.records.tables:aggregator_traffic", inputs=["accounting/communication.csv"],
         stages=["accounting"])
register("dose_response", "fedhisto.records.experiment_tables:dose_response",
         inputs=["experiments/dose_response/dose_response.csv", "experiments/dose_response/paired_differences.csv"],
         stages=EXPERIMENTS)
register("leakage", "fedhisto.records.experiment_tables:leakage",
         inputs=["experiments/leakage/leakage.csv", "experiments/leakage/inflation.csv"], stages=EXPERIMENTS)
register("leave_one_site_out", "fedhisto.records.experiment_tables:leave_one_site_out",
         inputs=["experiments/leave_one_site_out/leave_one_site_out.csv"], stages=EXPERIMENTS)
register("calibration", "fedhisto.records.experiment_tables:calibration",
         inputs=["experiments/calibration/calibration.csv"], stages=EXPERIMENTS)
register("probe", "fedhisto.records.experiment_tables:probe", inputs=["experiments/probe/probe.csv"],
         stages=EXPERIMENTS)
register("privacy_audit", "fedhisto.records.experiment_tables:privacy_audit",
         inputs=["experiments/privacy_audit/privacy_audit.csv"], stages=EXPERIMENTS)
register("sensitivity", "fedhisto.records.experiment_tables:sensitivity",
         inputs=["experiments/sensitivity/sensitivity.csv", "experiments/sensitivity/verdicts.csv"],
         stages=EXPERIMENTS)
register("lora_aggregation", "fedhisto.records.experiment_tables:lora_aggregation",
         inputs=["experiments/lora_aggregation/lora_aggregation.csv"], stages=EXPERIMENTS)

register("robustness", "fedhisto.metrics.robustness_reading:render", inputs=["metrics/robustness.csv"],
         stages=TRAINED, run="robustness")

# ------------------------------------------------------------------ blocks from committed records
register("reference_differences", "fedhisto.records.reference_table:render",
         record="benchmarks/records/reference_differences.json", made_by="python benchmarks/reference_differences.py")
register("first_command_timing", "fedhisto.records.first_command:render",
         record="benchmarks/records/first_command_timing.json", made_by="python benchmarks/first_command_timing.py",
         pending="**FIGURE PENDING:** not measured yet; on a quiet machine `python benchmarks/first_command_timing.py` "
                 "times the first command above in a fresh clone and `fedhisto records` writes the figure here.")

# ------------------------------------------------------------------ blocks from the code
register("secure_aggregation", "fedhisto.methods.secure_table:render_secure_aggregation", from_code=True)
register("secure_aggregation_learns", "fedhisto.methods.secure_table:render_what_the_coordinator_learns",
         from_code=True)
