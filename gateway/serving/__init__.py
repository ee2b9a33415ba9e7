"""Serving the port: uvicorn's server draining on SIGTERM (`draining_server.py`), `[server] workers = N` front
processes under a supervisor (`fronts.py`), and what the fronts tell each other about their pools
(`front_feed.py`)."""
