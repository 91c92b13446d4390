"""Reads the pipe tables of specs/*.md for the tests that keep specs and code registries in sync."""

from pathlib import Path

SPECS = Path(__file__).resolve().parent.parent / "specs"


def table_rows(text: str, header_start: str) -> list[list[str]]:
    """Cells of the table whose header line starts with `header_start` (backticks stripped)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("`") for c in line.strip("|").split("|")])
    return rows
