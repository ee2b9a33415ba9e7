"""The gateway's state that outlives a process and is shared by its replicas: API keys, usage records,
stored Responses (SQLite or Postgres through SQLAlchemy Core, schema by Alembic), and the counters of
rate limits and token budgets (in-process, or Redis for a fleet)."""
