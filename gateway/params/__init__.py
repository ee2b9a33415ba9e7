"""Translating each door's request parameters into the core request: sampling, limits, output constraints."""
