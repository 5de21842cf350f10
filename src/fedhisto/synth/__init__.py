"""Embedded synthetic H&E cohort: morphology, Beer-Lambert staining, sites, planted duplicates."""
