"""Alembic's environment: always called with a connection (gateway/store/database.py's migrate)."""

from alembic import context

from gateway.store.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations with `llmgw state migrate`, which passes the connection")
# batch mode: SQLite cannot ALTER most things; Alembic recreates the table there instead
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
