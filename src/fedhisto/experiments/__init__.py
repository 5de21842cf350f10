"""Controlled experiments the study could not run (``snakemake experiments``; designs in docs/experiments.md).

Each experiment is one module here holding its settings (``experiments.<name>``), its conditions,
the runs it needs, its Snakemake steps and its analysis, registered by one line in
:mod:`fedhisto.registries.experiment_registry`; it writes ``results/experiments/<name>/`` with a CSV, a JSON
with provenance and one figure, plus the per-image predictions they are computed from. What an
experiment is: :mod:`fedhisto.experiments.framework`; the shared layout and condition reuse of the main
pipeline's artifacts: :mod:`fedhisto.experiments.layout`.
"""
