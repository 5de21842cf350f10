"""The method and encoder registries, side by side: a plugin is one file and one registration here."""
