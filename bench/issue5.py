"""Issue 5 device run: ninfer bench on a full-size random-weight shape, several KV codecs and
speculative settings, each configuration written to OUT/<name>.json (no CLI dependencies).

    PYTHONPATH=. python bench/issue5.py qwen3.6-27b q4 OUT [config,config...]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from format.shapes import write_shape_artifact
from runtime.bench import BenchOptions, run_bench


def main(shape: str, recipe: str, out: str, only: str | None = None) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ninfer-bench-"))
    art = write_shape_artifact(shape, work / f"{shape}.nfer", recipe, mtp=True, lm_head_draft=32768)
    depths = [8192, 32768, 204800]
    configs = [
        ("plain", dict(kv_dtypes=["bf16", "int8", "rk4v4-e8"], depths=depths, prefill_limit=32768)),
        ("mtp3-a3", dict(kv_dtypes=["bf16"], depths=[8192], spec="mtp", draft_tokens=3, accepted_drafts=3)),
        ("mtp3-a2-lmhead", dict(kv_dtypes=["bf16"], depths=[8192], spec="mtp", draft_tokens=3, accepted_drafts=2,
                                lm_head_draft=True)),
        ("mtp3-a3-rk4v4-200k", dict(kv_dtypes=["rk4v4-e8"], depths=[204800], spec="mtp", draft_tokens=3,
                                    accepted_drafts=3, lm_head_draft=True, prefill_limit=0)),
    ]
    if only:
        configs = [c for c in configs if c[0] in only.split(",")]
    for name, kw in configs:
        t0 = time.perf_counter()
        try:
            res = run_bench(art, BenchOptions(decode_tokens=64, random_weights_seed=0, **kw))
        except Exception as exc:  # keep the remaining configurations running
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            continue
        res.update(shape=shape, recipe=recipe, config=name, wall_s=time.perf_counter() - t0)
        (out_dir / f"{shape}-{recipe}-{name}.json").write_text(json.dumps(res, indent=1))
        for r in res["rows"]:
            st = r.get("spec_stats") or {}
            print(f"{shape} {recipe} {name} kv={r['kv_dtype']} depth={r['depth']} ctx={r['context']} "
                  f"prefill={r['prefill_tok_s'] or 0:.0f} decode={r['decode_tok_s']:.1f} "
                  f"roofline={r.get('roofline_tok_s', 0):.1f} of={r.get('of_roofline', 0):.2f} "
                  f"tpr={st.get('tokens_per_round', 0):.2f} peakGiB={r.get('peak_allocated_bytes', 0) / 2**30:.2f}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
