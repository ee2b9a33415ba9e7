"""The generated reference pages (see docs/hooks/reference.py, the MkDocs hook that adds them)."""
