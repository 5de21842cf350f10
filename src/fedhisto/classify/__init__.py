"""Classify a new site's images with an exported model package (``fedhisto classify``)."""
