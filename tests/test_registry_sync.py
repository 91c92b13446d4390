"""specs/ tables and the code registries must say the same thing."""

import re

from format import container
from format.layouts import LAYOUTS
from format.numeric import FORMAT_LAYOUT, FORMATS, FloatCodeFormat, GroupedFormat

from .spec_tables import SPECS, table_rows as _table_rows


def test_format_table_matches_registry():
    rows = _table_rows((SPECS / "tensor-formats.md").read_text(), "| Name | Kind")
    assert [r[0] for r in rows] == list(FORMATS)
    for name, kind, bits, group, qmin, qmax, base, high, layout in rows:
        f = FORMATS[name]
        assert FORMAT_LAYOUT[name] == layout
        if kind == "grouped":
            assert isinstance(f, GroupedFormat)
            assert (f.bits, f.group_size, f.qmin, f.qmax, f.base_bytes_per_group, f.high_bytes_per_group) == (
                int(bits), int(group), int(qmin), int(qmax), int(base), int(high))
        elif kind == "float":
            assert isinstance(f, FloatCodeFormat) and f.code_bits == int(bits) and f.block == (0 if group == "–" else int(group))
        else:
            assert not isinstance(f, (GroupedFormat, FloatCodeFormat)) and f.word_bytes * 8 == int(bits)


def test_layout_table_matches_registry():
    rows = _table_rows((SPECS / "layouts.md").read_text(), "| Layout | Used by")
    assert sorted(r[0] for r in rows) == sorted(LAYOUTS)


def test_component_table_matches_container():
    rows = _table_rows((SPECS / "container.md").read_text(), "| Id | Holds")
    assert tuple(r[0] for r in rows) == tuple(sorted(container.COMPONENTS, key=[r[0] for r in rows].index))
    assert {r[0] for r in rows} == set(container.COMPONENTS)
    assert {r[0] for r in rows if r[2] == "yes"} == set(container.V2_COMPONENTS)


def test_recipes_documented():
    from format.recipes import RECIPES

    text = (SPECS / "inventory.md").read_text()
    rows = _table_rows(text, "| Role |")
    header = [c.strip() for c in next(l for l in text.splitlines() if l.startswith("| Role |")).strip("|").split("|")]
    for row in rows:
        role = row[0]
        for recipe, cell in zip(header[1:], row[1:]):
            assert RECIPES[recipe][role] == cell, (recipe, role)


def test_import_direction():
    """format <- runtime <- ninfer_cli; triton only under runtime/kernels."""
    root = SPECS.parent
    for py in (root / "format").rglob("*.py"):
        src = py.read_text()
        assert not re.search(r"^\s*(from|import) (runtime|ninfer_cli)\b", src, re.M), py
    for py in (root / "runtime").rglob("*.py"):
        assert not re.search(r"^\s*(from|import) ninfer_cli\b", py.read_text(), re.M), py
    for py in [p for pkg in ("format", "runtime", "ninfer_cli") for p in (root / pkg).rglob("*.py")]:
        if "kernels" not in py.parts:
            assert not re.search(r"^\s*(from|import) triton\b", py.read_text(), re.M), py
