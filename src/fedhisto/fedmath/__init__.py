"""Federated math: pure, typed, transport-free (aggregation, delta-SVD, weights, prototypes, losses)."""
