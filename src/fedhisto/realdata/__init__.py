"""Real dataset folders: what a folder holds (images, and everything else with a reason), which
patient or slide each image belongs to, and the inventory digest that makes Snakemake rerun the
cohort stage when an image is added, removed or edited."""
