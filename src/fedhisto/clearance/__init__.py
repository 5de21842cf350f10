"""Stage ``clearance``: exact, perceptual and local-feature duplicate families (study section 3.3)."""

from fedhisto.clearance.stage import ClearanceError, run_audit_folder, run_clearance

__all__ = ["ClearanceError", "run_audit_folder", "run_clearance"]
