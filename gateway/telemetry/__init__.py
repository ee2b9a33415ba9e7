"""Metrics, traces and access logs, labelled by model and backend."""
