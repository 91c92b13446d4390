"""The 35B-A3B's two expert GEMV launches of a decode step (gate/up with routing in the launch, down with
SwiGLU in the launch; the shared expert riding in both) over a sweep of tiles, at 1 and 8 tokens (lanes).
One token's launches take the "/one" tiles, more tokens' the others. Each timing replays a CUDA graph over 10
copies of a layer's experts (no replay reads them from L2) with
random routing; "of copy" = the distinct expert bytes the launch must read (each expert once) over the time,
against the measured copy bandwidth; every tile's output is checked against the default tile's.

    PYTHONPATH=. python bench/moe_decode_tiles.py OUT.json [TOKENS,...] [random|shared|fragment]

`shared`: the default tiles only, random routing beside every token of a step picking the same experts: whether a launch whose tokens
share experts reads them once (time near one token's) or once per token (time near random routing's) — the L2
may already merge the re-reads, since every pair's program of one row block runs at about the same time.
`fragment`: the launches over the routed experts in fragment order (moe_fragment), pair by pair with the routing
inside against expert-major (routed first: the route launch is in its gate/up time), random and shared routing.
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


def _layer(packed=random_packed, experts: int = EXPERTS):
    """One MoE layer's expert matrices (gate/up, down, shared gate/up, shared down) and their bytes (per routed
    expert, then the shared expert's)."""
    gate_up, gu_bytes = packed(experts * 2 * INTER, HIDDEN, "Q4G64_F16S")
    down, dn_bytes = packed(experts * HIDDEN, INTER, "Q5G64_F16S")
    shared_up, su_bytes = packed(2 * INTER, HIDDEN, "Q4G64_F16S")
    shared_down, sd_bytes = packed(HIDDEN, INTER, "Q5G64_F16S")
    return (gate_up, down, shared_up, shared_down), (gu_bytes / experts, dn_bytes / experts, su_bytes, sd_bytes)


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


def fragment(out_path: str, tokens_list: list[int], packed=None, timer=None, peak: float | None = None,
             experts: int = EXPERTS, top_k: int = TOP_K, copies: int = COPIES) -> dict:
    """The two expert launches over fragment-order experts, pair by pair (routing in the gate/up launch) and
    expert-major (moe.route first, then each expert once for every token that picked it), at each token count with
    random and shared routing: us per launch and "of copy" over the distinct expert bytes; expert-major's outputs
    against pair by pair's. `packed` / `timer` / `peak`: for a CPU smoke run (the defaults time on the GPU)."""
    from runtime.kernels import moe_fragment as mf
    from runtime.kernels.qgemm_fragment_layout import to_fragment_layout

    packed = packed or random_packed
    timer = timer or (lambda fn: graph_ms(fn) * 1e3)
    torch.manual_seed(0)
    peak = peak or copy_bandwidth()
    layers = []
    for _ in range(copies):
        (gate_up, down, shared_up, shared_down), per_expert = _layer(packed, experts)
        layers.append((to_fragment_layout(gate_up, "pairs"), to_fragment_layout(down, "pairs"), shared_up, shared_down))
    rides = mf.shared_rides(layers[0][2], 2 * INTER, HIDDEN) and mf.shared_rides(layers[0][3], HIDDEN, INTER)
    device = layers[0][0].base.device
    report = {"copy_GBs": peak / 1e9, "shared_rides": rides, "rows": []}
    for t, kind in itertools.product(tokens_list, ("random", "shared")):
        inputs = []
        for _ in range(copies):
            h = torch.randn(t, HIDDEN, device=device).to(torch.bfloat16)
            logits = torch.randn(1 if kind == "shared" else t, experts, device=device).expand(t, -1).contiguous()
            ids, weights = moe.route(logits, top_k)
            inputs.append((h, logits, ids.reshape(-1).contiguous(), weights))
        distinct = sum(len(set(ids.tolist())) for _, _, ids, _ in inputs) / copies
        nbytes = {"gate_up": distinct * per_expert[0] + per_expert[2] * (1 if rides else 0),
                  "down": distinct * per_expert[1] + per_expert[3] * (1 if rides else 0)}

        def gate_up(i, major):
            gu, _, su, _ = layers[i]
            h, logits, ids, _ = inputs[i]
            shared = su if rides else None
            if major:
                ids, _ = moe.route(logits, top_k)  # timed with the launch: expert-major routes first
                return mf.fragment_expert_gemv(h, ids.reshape(-1), gu, 2 * INTER, top_k, True, shared=shared,
                                               expert_major=True)
            pairs = torch.empty(t * top_k, dtype=torch.int32, device=device)
            weights = torch.empty(t, top_k, dtype=torch.float32, device=device)
            return mf.fragment_expert_gemv(h, pairs, gu, 2 * INTER, top_k, True, shared=shared,
                                           route_into=(logits, weights))

        acts = [gate_up(i, False) for i in range(copies)]

        def down(i, major):
            _, dn, _, sd = layers[i]
            return mf.fragment_expert_gemv(acts[i], inputs[i][2], dn, HIDDEN, top_k, False,
                                           shared=sd if rides else None, expert_major=major)

        for name, call in (("gate_up", gate_up), ("down", down)):
            want = call(0, False).float()
            for major in (False, True):
                got = call(0, major).float()
                cycle = itertools.cycle(range(copies))
                us = timer(lambda: call(next(cycle), major))
                row = {"product": name, "tokens": t, "routing": kind, "expert_major": major, "us": us,
                       "of_copy": nbytes[name] / (us * 1e-6) / peak, "distinct_experts": distinct,
                       "rel_err_vs_pairs": ((got - want).norm() / want.norm()).item()}
                report["rows"].append(row)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    return report


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
    tokens = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(",")]
    if len(sys.argv) > 3 and sys.argv[3] == "fragment":
        fragment(sys.argv[1], tokens)
    else:
        main(sys.argv[1], tokens, sys.argv[3] if len(sys.argv) > 3 else "random")
