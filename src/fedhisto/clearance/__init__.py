"""Stage ``clearance``: exact, perceptual and local-feature duplicate families (study section 3.3); entry :mod:`fedhisto.clearance.stage`."""
