"""Typed configuration: one strict model per pipeline stage (:mod:`fedhisto.config.study`), the blocks
of the data, model, privacy, experiments and classify settings, and what each stage depends on
(:mod:`fedhisto.config.stage_blocks`). Imports no torch."""
