"""The KV cache's blocks and their moves: the block pool with prefix caching (`block_manager.py`), a prompt's
KV out of one engine and into another (`transfer.py`), and the engine's side of that handover (`handover.py`)."""
