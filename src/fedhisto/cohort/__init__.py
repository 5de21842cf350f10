"""Stage ``cohort``: the embedded synthetic cohort or the user's real datasets as one sources table."""
