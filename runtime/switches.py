"""Every NINFER_* environment variable: its default and the values it takes.

The runtime's switches select kernels, tiles and schedules for side-by-side runs (a default changes only with a
measurement behind it). bench/SWITCHES.md says what each selects and why its default is what it is;
tests/test_switches.py keeps that table, this registry and the names the code reads in step. A module reads its
switch once, as a module constant, through `setting` (so a default is written here only) or, for a tile, through
kernels.tuning_from_env. `report_environment_once` runs first in every `ninfer` command and when an engine is built: a
value a switch does not take stops the run with one line naming the variable and what it takes, and a NINFER_* name
that is no switch (a typo would otherwise measure the default in silence) is named in a warning. No heavy imports
here: `ninfer --help` stays instant.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import dataclass

ENV_PREFIX = "NINFER_"


@dataclass(frozen=True)
class Switch:
    default: str  # what an unset variable means ("" where the default is derived: see bench/SWITCHES.md)
    choices: tuple[str, ...] = ()  # the values taken; empty: `form` instead
    form: str = ""  # a regular expression the whole value matches (tiles, lists, sizes)
    form_text: str = ""  # that form in words, for the error
    secret: bool = False  # never written into results or logs

    def accepts(self, value: str) -> bool:
        if self.choices:
            return value in self.choices
        return re.fullmatch(self.form, value.strip()) is not None

    def expected(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        return self.form_text


def _ints(n: int, names: str) -> dict:
    """Up to n comma-separated integers (kernels.tuning_from_env's form)."""
    return {"form": rf"-?\d+(\s*,\s*-?\d+){{0,{n - 1}}}", "form_text": f"up to {n} comma-separated integers ({names})"}


_COUNT = {"form": r"\d+", "form_text": "a whole number"}
_ON_OFF = ("on", "off")
_ONE_ZERO = ("1", "0")

SWITCHES: dict[str, Switch] = {
    # decode products
    "NINFER_GEMV": Switch("int8", ("int8", "float")),
    "NINFER_GEMV_ROWS": Switch("auto", ("auto", "tensor", "int8", "mma", "bf16", "lanes")),
    "NINFER_GEMV_FRAG": Switch("auto", ("auto", "on", "rows", "off", "layout")),
    "NINFER_FRAGMENT_INT8": Switch("off", ("off", "q5", "on")),
    "NINFER_FRAGMENT_PAIRS": Switch("1", _ONE_ZERO),
    "NINFER_Q5_FIELDS": Switch("on", _ON_OFF),
    "NINFER_FIELDS_REGS": Switch("128", ("128", "off")),
    "NINFER_FRAGMENT_W8": Switch("on", _ON_OFF),
    "NINFER_FRAGMENT_TILE": Switch("", **_ints(7, "hint,warps,programs,ksplit,xahead,xwide,tiles")),
    "NINFER_FRAGMENT_KS": Switch("", form=r"(\s*\d+[xX]\d+@\d+(-\d+)?=[124]\s*)?(,\s*\d+[xX]\d+@\d+(-\d+)?=[124]\s*)*",
                                 form_text="ROWSxCOLS@T1-T2=KS entries, comma-separated (KS 1, 2 or 4)"),
    "NINFER_FRAGMENT_KS_RULE": Switch("on", _ON_OFF),
    "NINFER_FRAGMENT_ONE_LANE": Switch("", form=r"[\w./,-]*", form_text="object-name suffixes, comma-separated"),
    "NINFER_FRAG_TILE": Switch("", **_ints(3, "hint,warps,programs")),
    "NINFER_ROWS_BF16_TILE": Switch("", **_ints(5, "rows,warps,stages,programs,prefetch")),
    "NINFER_SLICED_ROWS": Switch("1", _ONE_ZERO),
    "NINFER_HEAD_FRAGMENT": Switch("auto", ("auto", "off")),
    "NINFER_SWIGLU_EPILOGUE": Switch("1", _ONE_ZERO),
    "NINFER_SWIGLU_FRAGMENT": Switch("off", ("off", "1", "2", "4")),
    "NINFER_CONV_EPILOGUE": Switch("off", ("off", "on")),
    "NINFER_DENSE_ROWS": Switch("auto", ("auto", "off", "on", "all")),
    "NINFER_GEMM_DEQUANT_MB": Switch("64", **_COUNT),
    # norms
    "NINFER_RMSNORM_BARRIER": Switch("auto", ("auto", "1", "0")),
    "NINFER_RMSNORM_SPREAD_SPLITS": Switch("8", **_ints(1, "splits")),
    "NINFER_ROUTER_IN_NORM": Switch("0", **_ints(1, "rows")),
    "NINFER_GDN_NORM_EPILOGUE": Switch("off", ("off", "on")),
    # GDN
    "NINFER_GDN_TILE": Switch("", **_ints(2, "block_v,warps")),
    "NINFER_GDN_PREFILL": Switch("chunked", ("chunked", "recurrent")),
    "NINFER_CONV_SECTIONS": Switch("on", _ON_OFF),
    # attention
    "NINFER_ATTENTION_FRAG": Switch("auto", ("auto", "on", "off")),
    "NINFER_ATTENTION_FRAG_TILE": Switch("", **_ints(3, "warps,splits,hint")),
    "NINFER_ATTENTION_TILES": Switch("", form=r"(\s*[\w-]+=\d+x\d+(@\d+)?\s*)?(,\s*[\w-]+=\d+x\d+(@\d+)?\s*)*",
                                     form_text="KIND=KEYSxWARPS[@PROGRAMS] entries, comma-separated"),
    "NINFER_ATTENTION_LAUNCHES": Switch("fused", ("fused", "separate")),
    "NINFER_COMBINE_ROWS": Switch("16", **_COUNT),
    "NINFER_PREFILL_ATTENTION": Switch("auto", ("auto", "cudnn", "triton")),
    # mixture of experts
    "NINFER_MOE_DECODE": Switch("fused", ("fused", "separate")),
    "NINFER_MOE_FRAGMENT": Switch("auto", ("auto", "on", "off")),
    "NINFER_MOE_FRAGMENT_TILE": Switch("", **_ints(5, "gate_ks,down_bw,hint,expert_major,down_major")),
    "NINFER_MOE_SHARED_APART": Switch("0", **_ints(1, "rows")),
    "NINFER_MOE_PREFILL": Switch("auto", ("auto", "fused", "dense", "loop")),
    "NINFER_MOE_PREFILL_GRAPHS": Switch("on", _ON_OFF),
    "NINFER_TOPK_KEYED": Switch("1", _ONE_ZERO),
    # engine and server
    "NINFER_PDL": Switch("1", _ONE_ZERO),
    "NINFER_WEIGHT_CACHE": Switch("auto", ("auto", "off")),
    "NINFER_PIECE_GRAPHS": Switch("on", _ON_OFF),
    "NINFER_RIDE_ALIGN": Switch("on", _ON_OFF),
    "NINFER_DECODE_CHAIN": Switch("on", _ON_OFF),
    "NINFER_DFLASH2_KERNELS": Switch("fused", ("fused", "torch")),
    "NINFER_API_KEY": Switch("", form=r".*", form_text="a key", secret=True),
    # CPU runs and errors
    "NINFER_CPU_KERNELS": Switch("torch", ("torch", "triton")),
    "NINFER_CPU_DENSE_CACHE_MB": Switch("4096", **_COUNT),
    "NINFER_DEBUG": Switch("0", ("0", "1")),
    # the test suite and bench tools (read there, never by the runtime)
    "NINFER_AGENT_CLIS": Switch("", form=r".*", form_text="a folder"),
    "NINFER_SMOKE_DEVICE": Switch("cuda", form=r".*", form_text="a torch device"),
    "NINFER_AB_ROUNDS": Switch("3", **_COUNT),
    "NINFER_AB_STEPS": Switch("64", **_COUNT),
    "NINFER_BENCH_SHAPES": Switch("27b", ("27b", "35b")),
}

# families of switches named by what they tune: NINFER_EXPERT_TILE_<PRODUCT> (kernels.moe.expert_tile_variable)
SWITCH_FAMILIES: dict[str, Switch] = {
    "NINFER_EXPERT_TILE_": Switch("", **_ints(3, "block_n,block_k,warps")),
}


def switches_set(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The registered switches this process was given a value for (secrets left out): what a result records of
    the settings that produced it."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in sorted(environ.items())
            if name.startswith(ENV_PREFIX) and value and (switch := lookup(name)) is not None and not switch.secret}


class SwitchError(ValueError):
    """A NINFER_* variable holds a value its switch does not take."""


def lookup(name: str) -> Switch | None:
    if name in SWITCHES:
        return SWITCHES[name]
    for prefix, switch in SWITCH_FAMILIES.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            return switch
    return None


def setting(name: str) -> str:
    """A switch's value, read now: the environment's (an empty value counts as unset) or the registry's default.
    Raises SwitchError for a value the switch does not take (a run from the CLI has been stopped before that)."""
    switch = SWITCHES[name]
    value = os.environ.get(name, "")
    if not value:
        return switch.default
    if not switch.accepts(value):
        raise SwitchError(_refusal(name, value, switch))
    return value.strip() if switch.form else value


def _refusal(name: str, value: str, switch: Switch) -> str:
    return f"{name}={value!r} is not a value it takes: {switch.expected()}; unset it for the default (bench/SWITCHES.md)"


def check_environment(environ: dict[str, str] | None = None) -> list[str]:
    """Raise SwitchError for the first NINFER_* variable whose value its switch does not take; return a warning
    line for each NINFER_* name that is no switch (with the nearest switch's name when one is close)."""
    environ = os.environ if environ is None else environ
    warnings = []
    for name in sorted(n for n in environ if n.startswith(ENV_PREFIX)):
        switch = lookup(name)
        if switch is None:
            near = difflib.get_close_matches(name, list(SWITCHES), n=1, cutoff=0.8)
            hint = f" (did you mean {near[0]}?)" if near else ""
            warnings.append(f"{name} is not a ninfer switch{hint}; it has no effect (the switches: bench/SWITCHES.md)")
            continue
        value = environ[name]
        if value and not switch.accepts(value):
            raise SwitchError(_refusal(name, value, switch))
    return warnings


_reported = False  # the environment's strangers were named once in this process


def report_environment_once() -> None:
    """check_environment, its warnings on stderr once a process: the CLI calls it first, the engine when it is built
    (so bench tools and library users hear of a misspelled switch too)."""
    global _reported
    if _reported:
        return
    _reported = True
    for warning in check_environment():
        print(f"ninfer: warning: {warning}", file=sys.stderr)
