"""Every job that declares a GPU goes where GPUs are: the SLURM routing of the workflow's GPU rules.

A rule declares its GPUs with the resource ``gpu`` (training, prediction, classification, an experiment's
steps: from the encoder's registry entry, so the tiny encoder's jobs declare 0). Rule names are not fixed
(prediction rules are named by their seeds, experiment steps by their experiment), so a per-rule
``--set-resources <rule>:slurm_partition=...`` list misses rules as the configuration changes. Instead,
after the Snakefile has defined its rules, ``route_gpu_jobs`` gives every rule that has a ``gpu`` resource:

- ``slurm_partition``: evaluated per job: the resource ``slurm_gpu_partition`` (given with the profile's
  command, ``--default-resources ... slurm_gpu_partition=<gpu partition>``) when the job declares a GPU,
  else the partition the job had (``--default-resources slurm_partition=<partition>``). A rule whose
  partition is set by name (``--set-resources <rule>:slurm_partition=...``) keeps it; without
  ``slurm_gpu_partition`` every job keeps its partition (a cluster whose default partition has the GPUs);
- ``tasks_per_gpu=0``: snakemake-executor-plugin-slurm (>= 1.6.1) then adds no ``--ntasks-per-gpu`` to a
  GPU job's ``sbatch`` (versions before 2.0 added ``--ntasks-per-gpu=1`` by default, which newer SLURM
  rejects beside ``--cpus-per-task``: "SLURM_TRES_PER_TASK is mutually exclusive with --ntasks-per-gpu").
  A value set for a rule by name is kept;
- ``cpus_per_gpu=8`` (``CPUS_PER_GPU``), unless given (``--default-resources ... cpus_per_gpu=N`` for nodes
  with fewer cores per GPU): the plugin asks ``--cpus-per-gpu`` for a GPU job instead of one CPU per task,
  so the job's view workers (one per CPU it may use, less one) keep the GPU fed; a CPU job is unaffected.

Locally these resources are unused (no ``--resources`` limits them). Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

GPU_PARTITION = "slurm_gpu_partition"
#: CPUs a GPU job asks for beside its GPU: the threads that make its host views (``train.view_workers``)
CPUS_PER_GPU = 8


def _value(resource: Any, wildcards: Any, kwargs: dict) -> Any:
    """A resource's value for one job (a constant, or its callable evaluated as Snakemake would)."""
    if resource is None:
        return None
    return resource.evaluate(wildcards, **kwargs).value if resource.is_evaluable() else resource.value


def _declares_gpu(value: Any) -> bool:
    try:
        return int(value or 0) > 0
    except (TypeError, ValueError):  # "<TBD>" or a model string: a GPU is asked for
        return bool(value)


def _partition(gpu: Any, cpu_partition: Any, gpu_partition: Any):
    def partition(wildcards, **kwargs):
        if gpu_partition is not None and _declares_gpu(_value(gpu, wildcards, kwargs)):
            return _value(gpu_partition, wildcards, kwargs)
        return _value(cpu_partition, wildcards, kwargs)

    return partition


def route_gpu_jobs(workflow: Any) -> list[str]:
    """Give every rule with a ``gpu`` resource its per-job partition and ``tasks_per_gpu`` (module
    docstring). Returns the names of the rules routed."""
    from snakemake.resources import Resource

    named = workflow.resource_settings._parsed_overwrite_resources  # --set-resources <rule>:<name>=...
    routed = []
    for rule in workflow.rules:
        res = rule.resources
        if res is None or "gpu" not in res:
            continue
        own = named.get(rule.name, {})
        if "slurm_partition" not in own:
            # membership, not .get: Resources.get returns an empty Resource for a name it does not hold
            given = {k: res[k] if k in res else None for k in ("slurm_partition", GPU_PARTITION)}  # noqa: SIM401
            res["slurm_partition"] = Resource("slurm_partition", _partition(res["gpu"], given["slurm_partition"],
                                                                            given[GPU_PARTITION]))
        if "tasks_per_gpu" not in own:
            res["tasks_per_gpu"] = 0
        if "cpus_per_gpu" not in own and "cpus_per_gpu" not in res:
            res["cpus_per_gpu"] = CPUS_PER_GPU
        routed.append(rule.name)
    return routed
