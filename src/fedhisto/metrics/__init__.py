"""Stage ``metrics``: per-run, client-level, cross-seed, ensemble and subgroup tables."""
