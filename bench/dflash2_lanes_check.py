"""DFlash2 with two lanes in one batched round on the GPU (CUDA graphs for a batch of 2), on the tiny model:
each lane's speculative greedy output against its own plain greedy output.

    PYTHONPATH=. python bench/dflash2_lanes_check.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from format.convert import ConvertOptions, convert_checkpoint
from format.tiny import write_tiny_checkpoint, write_tiny_dflash2
from runtime.engine import Engine
from runtime.memory_plan import PlanOptions

PROMPTS = ([3, 17, 99, 150, 42, 7, 250, 11, 64, 300, 5, 128], [9, 8, 7, 6, 5, 4, 3, 2, 1, 200, 201, 202, 203, 204])
NEW = 24


def main(out: str) -> None:
    d = Path(out)
    src = write_tiny_checkpoint(d / "src", seed=3)
    art = convert_checkpoint(src, d / "tiny.nfer", ConvertOptions(recipe="q4", dflash2=write_tiny_dflash2(d / "drafter", src))).output
    plain = Engine(art, PlanOptions(max_context=256, prefill_chunk=128), device="cuda")
    want = [plain.generate(p, NEW) for p in PROMPTS]
    eng = Engine(art, PlanOptions(max_context=256, prefill_chunk=128, max_concurrency=2, spec="dflash2", draft_tokens=3),
                 device="cuda")
    outs = []
    for lane, p in enumerate(PROMPTS):
        outs.append([int(eng.prefill(lane, p).argmax())])
    while min(len(o) for o in outs) < NEW:
        budgets = [NEW - len(o) for o in outs]
        new = eng.speculator.round([0, 1], [o[-1] for o in outs], budgets)
        for o, tokens in zip(outs, new):
            o += tokens
    same = [sum(a == b for a, b in zip(o, w)) for o, w in zip(outs, want)]
    first_diff = [next((i for i, (a, b) in enumerate(zip(o, w)) if a != b), None) for o, w in zip(outs, want)]
    result = {"equal_tokens": same, "of": NEW, "first_difference": first_diff,
              "spec_stats": eng.speculator.stats.as_dict(), "graphs": sorted(map(str, eng._graphs))}
    print(json.dumps(result))
    (d / "lanes-check.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
