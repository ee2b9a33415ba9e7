"""Which backend serves a request: model routes (split, fallback, shadow), backend health, admission."""
