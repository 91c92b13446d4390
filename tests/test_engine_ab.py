"""bench/engine_ab.py's settings: parsed, applied to module attributes and table entries, and undone exactly (the
timed GPU run is on the device)."""

import pytest

from bench.engine_ab import apply_setting, parse_setting, summarize, undo_setting


def test_settings_apply_and_undo():
    from runtime.kernels import qgemm_fragment_layout as fl

    label, items = parse_setting("regs=runtime.kernels.qgemm_fragment_layout.FIELDS_REGS:128;"
                                 "runtime.kernels.qgemm_fragment_layout.FRAGMENT_TUNING[xahead]:0")
    assert label == "regs" and len(items) == 2
    before = (fl.FIELDS_REGS, dict(fl.FRAGMENT_TUNING))
    undo = apply_setting(items)
    assert fl.FIELDS_REGS == 128 and fl.FRAGMENT_TUNING["xahead"] == 0
    undo_setting(undo)
    assert (fl.FIELDS_REGS, fl.FRAGMENT_TUNING) == before
    assert parse_setting("base=") == ("base", [])


def test_a_table_entry_takes_a_whole_tile():
    """An expert tile (a key with a slash, a dict value) is set and undone whole."""
    from runtime.kernels import moe

    before = dict(moe.EXPERT_TUNING["down/one"])
    _, items = parse_setting('dn=runtime.kernels.moe.EXPERT_TUNING[down/one]:{"block_n":64,"block_k":512,"num_warps":4}')
    undo = apply_setting(items)
    assert moe.EXPERT_TUNING["down/one"] == {"block_n": 64, "block_k": 512, "num_warps": 4}
    undo_setting(undo)
    assert moe.EXPERT_TUNING["down/one"] == before


@pytest.mark.parametrize("text,problem", [("noequals", "is not label="), ("x=runtime.engine.NAME", "module.NAME:value"),
                                          ("x=runtime.engine.DENSE_ROWS_MIN_T:two", "not a Python literal")])
def test_malformed_settings_are_refused(text, problem):
    with pytest.raises(SystemExit, match=problem):
        parse_setting(text)


def test_unknown_attributes_are_refused():
    with pytest.raises(SystemExit, match="has no NO_SUCH"):
        apply_setting(parse_setting("x=runtime.engine.NO_SUCH:1")[1])
    with pytest.raises(SystemExit, match="has no key 'nokey'"):
        apply_setting(parse_setting("x=runtime.kernels.qgemm_fragment_layout.FRAGMENT_TUNING[nokey]:1")[1])


def test_summary_ratios_to_the_first_setting():
    s = summarize({"base": [10.0, 10.2, 9.8], "regs": [9.6, 9.4, 9.5]})
    assert s["base"]["median_ms"] == 10.0 and s["regs"]["median_ms"] == 9.5
    assert s["regs"]["x_first"] == pytest.approx(0.95) and s["base"]["x_first"] == 1.0
