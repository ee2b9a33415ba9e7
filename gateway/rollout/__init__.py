"""Staged rollouts of a model from its backend to a candidate, gated on latency, errors and output parity."""
