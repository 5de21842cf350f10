"""Stage experiments' entry (``scripts/experiments.py``): find the job's step among the registered
experiments' steps by its rule's name and run it.

Every step but two (rendering the shifted cohort, which forks a process pool, and building a condition's
manifest, which needs no torch) hands its function to the warm server (``fedhisto.infra.warm_server.call``), as the
main stages' scripts do: an experiments run is mostly short torch jobs (a sensitivity run alone has 94),
each of which otherwise spent its first seconds importing torch, transformers and peft. The functions
and arguments are those of a cold job; only the process that runs them differs.
"""

from __future__ import annotations

from typing import Any

from fedhisto.config.study import Config
from fedhisto.experiments.layout import steps

#: The shared condition rule this entry runs (the others run the main stages' own scripts).
BUILD_CONDITION_MANIFEST = "build_condition_manifest"


def run_step(smk: Any, cfg: Config) -> Any:
    """Run the step of ``smk.rule`` (a condition's manifest: the experiment that owns the condition)."""
    if smk.rule == BUILD_CONDITION_MANIFEST:
        from fedhisto.registries.experiment_registry import owner

        condition = smk.wildcards.condition
        return owner(condition).build_manifest(cfg, condition, smk)
    step = next((s for s in steps(cfg) if s.rule == smk.rule), None)
    if step is None:
        raise SystemExit(f"scripts/experiments.py: rule {smk.rule!r} is no registered experiment's step")
    return step.run(smk, cfg)


def run(smk: Any) -> Any:
    """The script's entry: the config and the rule's log set up as every stage's, then the step."""
    from fedhisto.entry import from_snakemake

    return run_step(smk, from_snakemake(smk))
