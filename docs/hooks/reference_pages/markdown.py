"""Markdown for the reference pages: inline code and table cells that survive `|`, tables."""

from __future__ import annotations


def code(text: str) -> str:
    """Inline code in a table cell. A `|` inside backticks splits GitHub's table cells and shows its escape in
    Python-Markdown's, so such code is written as HTML with the bar as an entity."""
    if "|" in text or "`" in text:
        escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")
        return f"<code>{escaped}</code>"
    return f"`{text}`"


def cell(text: str) -> str:
    """Markdown text (a doc string) in one table cell: one line, `|` escaped, `<` kept from becoming HTML."""
    out = []
    for i, part in enumerate(" ".join(text.split()).split("`")):
        if i % 2:  # inside a code span
            out.append(code(part) if "|" in part else f"`{part}`")
        else:
            out.append(part.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*"))
    return "".join(out)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def slug(path: str) -> str:
    """An anchor: a key path or a name, lowercased, every run of other characters one hyphen."""
    slug = "".join(c if c.isalnum() else "-" for c in path.replace("<name>", "name").lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return slug
