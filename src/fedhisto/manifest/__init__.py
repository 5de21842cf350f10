"""Stage ``manifest``: the canonical manifest, five non-IID clients, fixed validation and test."""
