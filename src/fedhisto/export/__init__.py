"""Export a method's ensemble as a portable model package (``fedhisto export``)."""
