"""The CPU the engine runs on: its ISA and features, and the kernels compiled for it (`csrc/`)."""
