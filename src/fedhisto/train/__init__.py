"""Stage ``train``: one federated run per method and seed, resumable round by round."""
