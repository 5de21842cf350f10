"""Stage ``accounting``: communication per round from the real tensor shapes and messages."""
