"""Stage ``stain``: the clients' 14-d stain descriptors."""
