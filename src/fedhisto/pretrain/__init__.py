"""Stage ``pretrain``: features for the tiny encoder of the embedded default."""
