"""Controlled experiments the study could not run (``snakemake experiments``; designs in docs/experiments.md).

Six experiments, each under ``results/experiments/<name>/`` with a CSV, a JSON with provenance and
one figure, plus the per-image predictions they are computed from:

- ``dose_response``: the external cohort re-rendered at several stain/scanner shift severities,
  crossed with the tiny encoder's stain invariance (pretrained with or without stain views);
- ``leakage``: the same methods and seeds on a split that ignores augmentation families vs the
  clean policies (``representatives``, ``whole_families``);
- ``leave_one_site_out``: FedStain's domain-generalisation protocol, four clients train and the
  fifth site's images test;
- ``calibration``: temperature scaling per checkpoint, fitted on its validation predictions;
- ``probe``: the stain-sensitivity probe of each dose-response encoder (:mod:`fedhisto.model.stain_probe`),
  beside its v2-vs-FedAvg-PEFT gap: does it rank the encoders as the gap does?
- ``sensitivity``: the study's unstated choices read other ways, one at a time against one baseline,
  and which headline conclusions keep their sign and interval under every reading.

Layout and reuse of the main pipeline's artifacts: :mod:`fedhisto.experiments.layout`.
"""
