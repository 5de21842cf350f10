"""Stage ``bootstrap``: paired bootstrap of a named comparison (resampling: :mod:`fedhisto.stats.resampling`)."""
