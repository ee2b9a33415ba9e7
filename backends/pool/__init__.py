"""Replica pools: one backend made of N replica backends, a swappable balancer over per-replica
signals, a bounded prefix index, per-replica health and DNS discovery (see `pool.py`)."""
