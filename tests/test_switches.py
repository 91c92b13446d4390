"""bench/SWITCHES.md, runtime/switches.py and the NINFER_* names the code reads stay in step, and `ninfer` rejects a
switch value it does not take in one line."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.switches import SWITCH_FAMILIES, SWITCHES, Switch, SwitchError, check_environment, lookup

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"NINFER_[A-Z0-9_]+")


def _doc_rows() -> dict[str, list[str]]:
    """bench/SWITCHES.md's table rows by variable: [default, values, what it selects]."""
    rows = {}
    for line in (ROOT / "bench" / "SWITCHES.md").read_text().splitlines():
        if line.startswith("| `NINFER_"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            name = cells[0].strip("`").replace("<PRODUCT>", "")
            assert name not in rows, f"{name} has two rows"
            rows[name] = cells[1:]
    return rows


def _names_read(folders: list[str], suffixes: tuple[str, ...]) -> set[str]:
    """NINFER_* names in those folders' files (this test's made-up ones aside), a family's bare prefix left out."""
    names = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in suffixes and path.name != Path(__file__).name:
                names |= set(NAME.findall(path.read_text(errors="replace")))
    return names - set(SWITCH_FAMILIES)


def test_every_switch_has_one_row_with_its_default():
    rows = _doc_rows()
    assert set(rows) == set(SWITCHES) | set(SWITCH_FAMILIES)
    for name, (default, values, _what) in rows.items():
        switch = SWITCHES.get(name) or SWITCH_FAMILIES[name]
        assert default == (f"`{switch.default}`" if switch.default else "`—`"), name
        if switch.choices:  # the row lists exactly the values the registry takes
            assert re.findall(r"`([^`]*)`", values) == list(switch.choices), name


def test_every_default_is_a_value_its_switch_takes():
    for name, switch in SWITCHES.items():
        assert bool(switch.choices) != bool(switch.form), name
        if switch.default and switch.form != r".*":
            assert switch.accepts(switch.default), name


def test_every_name_the_code_and_tools_read_is_a_switch():
    read = _names_read(["runtime", "format", "ninfer_cli", "bench"], (".py", ".sh"))
    # (tests: made-up names of the tuning parser's and the bench record's tests, a marker the agent tests look for)
    read |= _names_read(["tests"], (".py",)) - {"NINFER_TEST_TILE", "NINFER_NOT_A_SWITCH", "NINFER_TOOL_RAN_42"}
    assert {n for n in read if lookup(n) is None} == set()


def test_every_switch_is_read_somewhere():
    runtime_names = _names_read(["runtime", "format", "ninfer_cli"], (".py",))
    tool_names = _names_read(["bench", "tests"], (".py", ".sh"))
    for name in SWITCHES:
        assert name in runtime_names or name in tool_names, f"{name} is registered but nothing reads it"
    for prefix in SWITCH_FAMILIES:
        assert prefix in (ROOT / "runtime" / "kernels" / "moe.py").read_text()
    readme = (ROOT / "README.md").read_text()
    assert {n for n in NAME.findall(readme) if lookup(n) is None} - set(SWITCH_FAMILIES) == set()


def test_check_environment_rejects_a_value_and_names_a_stranger():
    assert check_environment({"NINFER_PIECE_GRAPHS": "off", "NINFER_FRAGMENT_TILE": "2, 4,528",
                              "NINFER_EXPERT_TILE_DOWN_ONE": "32,512,8", "NINFER_FRAGMENT_KS": "34816x5120@1-8=4",
                              "NINFER_ATTENTION_TILES": "int4g64e8=64x4@1024,nvfp4=16x4", "PATH": "/bin"}) == []
    with pytest.raises(SwitchError, match=r"NINFER_PIECE_GRAPHS='yes' is not a value it takes: one of on, off"):
        check_environment({"NINFER_PIECE_GRAPHS": "yes"})
    with pytest.raises(SwitchError, match=r"NINFER_FRAGMENT_TILE='2,4,x' .* up to 7 comma-separated integers"):
        check_environment({"NINFER_FRAGMENT_TILE": "2,4,x"})
    with pytest.raises(SwitchError, match="NINFER_FRAGMENT_KS"):
        check_environment({"NINFER_FRAGMENT_KS": "34816x5120@1-8=3"})
    with pytest.raises(SwitchError, match="NINFER_EXPERT_TILE_DOWN"):
        check_environment({"NINFER_EXPERT_TILE_DOWN": "32,512,8,1"})
    [warning] = check_environment({"NINFER_PIECE_GRAPH": "off"})
    assert "NINFER_PIECE_GRAPH is not a ninfer switch (did you mean NINFER_PIECE_GRAPHS?)" in warning
    [warning] = check_environment({"NINFER_SOMETHING": "1"})
    assert "did you mean" not in warning
    assert Switch("on", ("on", "off")).expected() == "one of on, off"


def test_ninfer_stops_on_a_switch_value_in_one_line():
    def run(env: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ninfer_cli.main", "--help"], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", **env}, cwd=ROOT)

    bad = run({"NINFER_DENSE_ROWS": "sometimes"})
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "error: NINFER_DENSE_ROWS='sometimes' is not a value it takes: one of auto, off, on, all; unset it for the "
        "default (bench/SWITCHES.md)"]
    typo = run({"NINFER_DENSE_ROW": "on"})
    assert typo.returncode == 0 and "Usage" in typo.stdout
    assert "warning: NINFER_DENSE_ROW is not a ninfer switch (did you mean NINFER_DENSE_ROWS?)" in typo.stderr


def test_modules_read_switches_through_the_registry():
    """A switch's default lives in runtime/switches.py only: no module reads a NINFER_* variable from the
    environment itself (tiles go through kernels.tuning_from_env, which the registry's forms mirror)."""
    direct = re.compile(r"""environ(\.get\(|\[)\s*["']NINFER_""")
    offenders = [str(p.relative_to(ROOT)) for folder in ("runtime", "format", "ninfer_cli")
                 for p in (ROOT / folder).rglob("*.py") if direct.search(p.read_text())]
    assert offenders == []


def test_setting_gives_the_default_the_value_or_one_line(monkeypatch):
    from runtime.switches import setting

    monkeypatch.delenv("NINFER_COMBINE_ROWS", raising=False)
    assert setting("NINFER_COMBINE_ROWS") == "16"
    monkeypatch.setenv("NINFER_COMBINE_ROWS", "")  # empty: unset
    assert setting("NINFER_COMBINE_ROWS") == "16"
    monkeypatch.setenv("NINFER_COMBINE_ROWS", " 8 ")
    assert setting("NINFER_COMBINE_ROWS") == "8"
    monkeypatch.setenv("NINFER_COMBINE_ROWS", "many")
    with pytest.raises(SwitchError, match="NINFER_COMBINE_ROWS='many' is not a value it takes: a whole number"):
        setting("NINFER_COMBINE_ROWS")


def test_strangers_are_named_once_a_process(monkeypatch, capsys):
    import runtime.switches as switches

    monkeypatch.setattr(switches, "_reported", False)
    monkeypatch.setenv("NINFER_PIECE_GRAPH", "off")
    switches.report_environment_once()
    switches.report_environment_once()  # (the CLI, then the engine it builds)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["ninfer: warning: NINFER_PIECE_GRAPH is not a ninfer switch (did you mean NINFER_PIECE_GRAPHS?); "
                     "it has no effect (the switches: bench/SWITCHES.md)"]
