"""Engine settings side by side in one process: one engine, its CUDA-graph decode steps timed under each setting in
turn, alternated over several rounds, so every setting runs on the same weights at the same addresses, the same
clocks and the same compiled kernels. Separate bench processes of one configuration differ by up to ~5 % (27B lanes)
and ~8 % (35B-A3B) among themselves, which hides the 1-3 % a kernel option moves a step.

    PYTHONPATH=. python bench/engine_ab.py SHAPE OUT.json LANES SETTING [SETTING...]

LANES: lane counts, comma-separated (each count's lanes decode together, 8K context each). SETTING:
`label=` (the engine as loaded) or `label=module.NAME:value[;module.NAME[key]:value...]`, module attributes the
runtime reads at call time (values Python literals), e.g.

    base=  regs=runtime.kernels.qgemm_fragment_layout.FIELDS_REGS:128
    dense=runtime.engine.DENSE_ROWS_MIN_T:1

Each (setting, round): the attributes set, the engine's graphs dropped so the next step captures anew, 3 warm-up
steps, STEPS (NINFER_AB_STEPS, 64) chained steps timed by CUDA events (tokens picked on the device), attributes
restored. Prints ms a step per setting and round, the median, and its ratio to the first setting; OUT.json holds the
same. Only settings read when a step is captured take effect: ones the engine reads at load (weight layouts) do not.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

SETTING_ITEM = re.compile(r"^([\w.]+)\.(\w+)(?:\[([\w/]+)\])?:(.+)$")  # keys like gate_up/one


def parse_setting(text: str) -> tuple[str, list[tuple[str, str, str | None, object]]]:
    """'label=mod.NAME:1;mod.TABLE[key]:2' -> (label, [(module, attribute, key or None, value)])."""
    label, sep, body = text.partition("=")
    if not sep or not label:
        raise SystemExit(f"engine_ab: setting {text!r} is not label=[module.NAME:value;...]")
    items = []
    for part in filter(None, body.split(";")):
        m = SETTING_ITEM.match(part.strip())
        if not m:
            raise SystemExit(f"engine_ab: {part!r} in setting {label!r} is not module.NAME:value or "
                             "module.NAME[key]:value")
        try:
            value = ast.literal_eval(m.group(4))
        except (ValueError, SyntaxError):
            raise SystemExit(f"engine_ab: value {m.group(4)!r} in setting {label!r} is not a Python literal")
        items.append((m.group(1), m.group(2), m.group(3), value))
    return label, items


def apply_setting(items: list) -> list:
    """Set each item; returns what undoes them (in reverse order)."""
    undo = []
    for module_name, attr, key, value in items:
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise SystemExit(f"engine_ab: {module_name} has no {attr}")
        if key is None:
            undo.append((module, attr, None, getattr(module, attr)))
            setattr(module, attr, value)
        else:
            table = getattr(module, attr)
            if key not in table:
                raise SystemExit(f"engine_ab: {module_name}.{attr} has no key {key!r}")
            undo.append((table, None, key, table[key]))
            table[key] = value
    return undo[::-1]


def undo_setting(undo: list) -> None:
    for target, attr, key, old in undo:
        if key is None:
            setattr(target, attr, old)
        else:
            target[key] = old


def summarize(times: dict[str, list[float]]) -> dict[str, dict]:
    """Per setting: its rounds (ms a step), the median, and the median's ratio to the first setting's."""
    first = statistics.median(next(iter(times.values())))
    return {label: {"rounds_ms": ms, "median_ms": statistics.median(ms),
                    "x_first": statistics.median(ms) / first} for label, ms in times.items()}


def main(shape: str, out: str, lanes: str, *settings: str) -> None:
    import torch

    from format.shapes import write_shape_artifact
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions

    parsed = [parse_setting(s) for s in settings]
    if len(parsed) < 2:
        raise SystemExit("engine_ab: give two or more settings to compare")
    counts = [int(n) for n in lanes.split(",")]
    rounds, steps = int(os.environ.get("NINFER_AB_ROUNDS", "3")), int(os.environ.get("NINFER_AB_STEPS", "64"))
    depth = 8192
    advance = rounds * len(parsed) * (steps + 3) * len(counts)
    art = write_shape_artifact(shape, Path(tempfile.mkdtemp()) / f"{shape}.nfer", "q4")
    eng = Engine(art, PlanOptions(max_context=depth + advance + 64, prefill_chunk=2048, kv_dtype="bf16",
                                  max_concurrency=max(counts)), device="cuda", random_weights_seed=0)
    for lane in range(max(counts)):
        eng.prefill(lane, [1 + (lane * 7 + i) % 30000 for i in range(depth)])
    results = {}
    for n in counts:
        ids = list(range(n))
        tokens = torch.ones(n, dtype=torch.long, device="cuda")
        times: dict[str, list[float]] = {label: [] for label, _ in parsed}
        for r in range(rounds):
            for label, items in parsed:
                undo = apply_setting(items)
                try:
                    eng._graphs.clear()  # the next step captures under this setting
                    for _ in range(3):
                        tokens = eng.decode_step(ids, None, device_tokens=tokens).argmax(-1)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(steps):
                        tokens = eng.decode_step(ids, None, device_tokens=tokens).argmax(-1)
                    end.record()
                    torch.cuda.synchronize()
                finally:
                    undo_setting(undo)
                times[label].append(start.elapsed_time(end) / steps)
                print(f"{shape} {n} lane(s) round {r} {label}: {times[label][-1]:.3f} ms a step", file=sys.stderr)
        results[str(n)] = summarize(times)
        for label, s in results[str(n)].items():
            print(f"{shape} {n} lane(s) {label:12s} median {s['median_ms']:.3f} ms ({s['x_first']:.3f}x first) "
                  f"rounds " + " ".join(f"{m:.3f}" for m in s["rounds_ms"]))
    Path(out).write_text(json.dumps({"shape": shape, "steps": steps, "rounds": rounds, "settings": list(settings),
                                     "lanes": results}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) < 5:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
