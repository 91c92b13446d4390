"""The 35B-A3B's two expert GEMV launches of a decode step (gate/up with routing in the launch, down with
SwiGLU in the launch; the shared expert riding in both) over a sweep of tiles, at 1 and 8 tokens (lanes).
One token's launches take the "/one" tiles, more tokens' the others. Each timing replays a CUDA graph over 10
copies of a layer's experts (no replay reads them from L2) with
random routing; "of copy" = the distinct expert bytes the launch must read (each expert once) over the time,
against the measured copy bandwidth; every tile's output is checked against the default tile's.

    PYTHONPATH=. python bench/moe_decode_tiles.py OUT.json [TOKENS,...] [random|shared]

`shared`: the default tiles only, random routing beside every token of a step picking the same experts: whether a launch whose tokens
share experts reads them once (time near one token's) or once per token (time near random routing's) — the L2
may already merge the re-reads, since every pair's program of one row block runs at about the same time.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from bench.attention_compare import graph_ms
from bench.gpu_check import copy_bandwidth, random_packed
from runtime.kernels import moe

HIDDEN, INTER, EXPERTS, TOP_K, COPIES = 2048, 512, 256, 8, 10
GATE_UP_TILES = [(bn, bk, w) for bn in (16, 32, 64) for bk in (256, 512, 1024) for w in (4, 8)]
DOWN_TILES = [(bn, bk, w) for bn in (16, 32, 64, 128) for bk in (128, 256, 512) for w in (4, 8)]


def _layer():
    gate_up, gu_bytes = random_packed(EXPERTS * 2 * INTER, HIDDEN, "Q4G64_F16S")
    down, dn_bytes = random_packed(EXPERTS * HIDDEN, INTER, "Q5G64_F16S")
    shared_up, su_bytes = random_packed(2 * INTER, HIDDEN, "Q4G64_F16S")
    shared_down, sd_bytes = random_packed(HIDDEN, INTER, "Q5G64_F16S")
    return (gate_up, down, shared_up, shared_down), (gu_bytes / EXPERTS, dn_bytes / EXPERTS, su_bytes, sd_bytes)


def main(out_path: str, tokens_list: list[int], routing: str = "random") -> None:
    if routing not in ("random", "shared"):
        raise SystemExit(f"routing {routing!r}: give random or shared")
    torch.manual_seed(0)
    peak = copy_bandwidth()
    layers = [_layer() for _ in range(COPIES)]
    expert_bytes = layers[0][1]
    report = {"copy_GBs": peak / 1e9, "routing": routing, "rows": []}
    default = {name: dict(tile) for name, tile in moe.EXPERT_TUNING.items()}
    for t in tokens_list:
        for kind in (["random"] if routing == "random" else ["random", "shared"]):
            inputs = []
            for _ in range(COPIES):
                h = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
                logits = torch.randn(1 if kind == "shared" else t, EXPERTS, device="cuda").expand(t, -1).contiguous()
                inputs.append((h, logits, torch.empty(t * TOP_K, dtype=torch.int32, device="cuda"),
                               torch.empty(t, TOP_K, dtype=torch.float32, device="cuda")))
            picked = [set(torch.topk(logits, TOP_K, -1).indices.flatten().tolist()) for _, logits, _, _ in inputs]
            distinct = sum(map(len, picked)) / COPIES
            gate_up_bytes = distinct * expert_bytes[0] + expert_bytes[2]
            down_bytes = distinct * expert_bytes[1] + expert_bytes[3]

            def gate_up_call(i):
                (gu, _, su, _), _ = layers[i]
                h, logits, pairs, weights = inputs[i]
                return moe.expert_gemv(h, TOP_K, pairs, gu, 2 * INTER, shared=su, route_into=(logits, weights))

            rows_in = [gate_up_call(i) for i in range(COPIES)]  # the down launch's inputs (and the routing)

            def down_call(i):
                (_, dn, _, sd), _ = layers[i]
                return moe.expert_gemv(rows_in[i], 1, inputs[i][2], dn, HIDDEN, shared=sd, shared_x0=t * TOP_K, swiglu=True)

            for name, tiles, call, nbytes in (("gate_up", GATE_UP_TILES, gate_up_call, gate_up_bytes),
                                             ("down", DOWN_TILES, down_call, down_bytes)):
                moe.EXPERT_TUNING.update({k: dict(v) for k, v in default.items()})
                key = name + ("/one" if t * (TOP_K + 1) <= moe.ONE_TOKEN_PAIRS else "")  # the tile this launch takes
                want = call(0).float()
                own = tuple(default[key][k] for k in ("block_n", "block_k", "num_warps"))
                for bn, bk, w in tiles if routing == "random" else [own]:
                    moe.EXPERT_TUNING[key] = {"block_n": bn, "block_k": bk, "num_warps": w}
                    try:
                        got = call(0).float()
                        err = ((got - want).norm() / want.norm()).item()
                        cycle = itertools.cycle(range(COPIES))
                        us = graph_ms(lambda: call(next(cycle))) * 1e3
                    except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses: recorded, sweep goes on
                        print(json.dumps({"product": name, "tokens": t, "tile": [bn, bk, w], "error": str(exc)[:200]}))
                        continue
                    row = {"product": key, "tokens": t, "routing": kind, "tile": [bn, bk, w], "us": us,
                           "of_copy": nbytes / (us * 1e-6) / peak,
                           "rel_err_vs_default": err, "default": [bn, bk, w] == [default[key][k] for k in
                                                                              ("block_n", "block_k", "num_warps")]}
                    report["rows"].append(row)
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        moe.EXPERT_TUNING.update({k: dict(v) for k, v in default.items()})
    swept = [r for r in report["rows"] if r["routing"] == "random"]  # the tile sweep's rows (shared: default only)
    for t in tokens_list:
        for name in moe.EXPERT_TUNING:
            rows = [r for r in swept if r["tokens"] == t and r["product"] == name]
            if rows:
                best, base = min(rows, key=lambda r: r["us"]), next((r for r in rows if r["default"]), None)
                print(f"{name} T={t}: default {base['us'] if base else float('nan'):.1f} us; best {best['tile']} "
                      f"{best['us']:.1f} us ({best['of_copy']:.2f} of copy)")
    report["pick"] = pick(swept)
    print(report["pick"])
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


def pick(rows: list[dict]) -> str:
    """Per product (and "/one": one token's launch), the tile with the least sum over token counts of its time
    relative to the default's (so several lane counts weigh alike), as environment assignments for `env`."""
    parts = []
    for name in moe.EXPERT_TUNING:
        mine = [r for r in rows if r["product"] == name and r["rel_err_vs_default"] < 1e-2]
        base = {r["tokens"]: r["us"] for r in mine if r["default"]}
        score: dict[tuple, float] = {}
        for r in mine:
            if r["tokens"] in base:
                score[tuple(r["tile"])] = score.get(tuple(r["tile"]), 0.0) + r["us"] / base[r["tokens"]]
        full = [tile for tile in score if sum(1 for r in mine if tuple(r["tile"]) == tile) == len(base)]
        if full:
            parts.append(f"{moe.expert_tile_variable(name)}=" + ",".join(map(str, min(full, key=score.get))))
    return " ".join(parts)


if __name__ == "__main__":
    main(sys.argv[1], [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(",")],
         sys.argv[3] if len(sys.argv) > 3 else "random")
