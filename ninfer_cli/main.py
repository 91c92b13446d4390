"""`ninfer`: convert, inspect, generate and demo over one runtime."""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from ._common import err, friendly, human_bytes, out, prepare_device, printable

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Run one Qwen3.5-family model on one GPU at its physical limit.")

class WeightCache(str, Enum):
    auto = "auto"
    off = "off"


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of a table.")]
WeightCacheOpt = Annotated[WeightCache, typer.Option(help="auto: keep dense copies of the layer weights in GPU memory the plan leaves spare (prefill, and decoding lanes riding a prefill chunk, skip dequantizing them; the context asked for always comes first); off: leave that memory free.")]
VerifyWeightsOpt = Annotated[bool, typer.Option("--verify-weights", help="Recompute every object's sha256 before loading (v3; a progress bar on stderr).")]
PrefillChunkOpt = Annotated[str, typer.Option(
    help="Prefill chunk in tokens (a multiple of 128), or auto: the largest of 8192/4096/2048/1024 whose "
         "activation workspace is at most 1/32 of the card's memory (1024 on CPU).")]


class Recipe(str, Enum):
    q4 = "q4"
    q5 = "q5"
    q6 = "q6"
    w8 = "w8"
    bf16 = "bf16"


@app.command()
@friendly
def convert(
    src: Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer); with --from-artifact, the output.")],
    output: Annotated[Optional[Path], typer.Argument(help="Output .nfer file (written to a temp file, then renamed).")] = None,
    from_artifact: Annotated[Optional[Path], typer.Option(help="Re-write this artifact (any version this build reads) as version 3: `convert --from-artifact OLD.nfer NEW.nfer`.")] = None,
    version: Annotated[int, typer.Option(help="Container version: 2 (text + vision) or 3 (adds companion weights).")] = 3,
    recipe: Annotated[Recipe, typer.Option(help="Weight formats: q4 | q5 | q6 | w8 | bf16.")] = Recipe.q4,
    mtp: Annotated[Optional[bool], typer.Option("--mtp/--no-mtp", help="Carry the MTP head (default: when present, v3 only).")] = None,
    vision: Annotated[Optional[bool], typer.Option("--vision/--no-vision", help="Carry the vision tower (default: when present).")] = None,
    vision_recipe: Annotated[str, typer.Option(help="The vision tower's matrices: bf16 (as the checkpoint, ~0.9 GB on the 27B), w8 or q6.")] = "bf16",
    lm_head_draft: Annotated[int, typer.Option(help="Rows of a frequency-ranked lm-head draft (v3; 0 = none).")] = 0,
    draft_ranking: Annotated[Optional[Path], typer.Option(help="Per-token i64 counts ranking the draft rows (.npy or raw LE).")] = None,
    dflash2: Annotated[Optional[Path], typer.Option(help="DFlash2 drafter checkpoint directory to carry (v3).")] = None,
    checksums: Annotated[bool, typer.Option("--checksums/--no-checksums", help="Per-object sha256 (v3).")] = True,
    as_json: JsonOpt = False,
):
    """Convert a Hugging Face qwen3_5 / qwen3_5_moe checkpoint into a .nfer artifact (or re-write an artifact
    as version 3 with --from-artifact)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from format.convert import ConvertOptions, convert_checkpoint, rewrite_artifact
    from format.errors import ConvertError

    if from_artifact is not None:
        if output is not None:
            raise ConvertError("with --from-artifact give one path, the output: ninfer convert --from-artifact OLD.nfer NEW.nfer")
        source, output = from_artifact, src
        run = lambda progress: rewrite_artifact(source, output, checksums, progress)  # noqa: E731
    elif output is None:
        raise ConvertError("give the checkpoint directory and the output file: ninfer convert SRC_DIR OUT.nfer")
    else:
        opts = ConvertOptions(version=version, recipe=recipe.value, mtp=mtp, vision=vision, vision_recipe=vision_recipe,
                              lm_head_draft=lm_head_draft, draft_ranking=draft_ranking, dflash2=dflash2,
                              checksums=checksums)
        run = lambda progress: convert_checkpoint(src, output, opts, progress)  # noqa: E731
    with Progress(TextColumn("converting"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                  TimeRemainingColumn(), console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("convert", total=None)
        report = run(lambda done, total: bar.update(task, completed=done, total=total))
    from rich.markup import escape

    for note in report.notes:
        err.print(f"[yellow]note:[/yellow] {escape(note)}", soft_wrap=True)
    if as_json:
        print(json.dumps(report.__dict__))
        return
    out.print(f"wrote {report.output}: v{report.version} {report.model_type} recipe {report.recipe}, "
              f"{report.objects} objects, {human_bytes(report.file_bytes)}, components {', '.join(report.components)}")
    for fmt, n in sorted(report.bytes_by_format.items()):
        out.print(f"  {fmt:<12} {human_bytes(n):>12}")
    err.print(f"{report.seconds:.1f} s, peak RSS {human_bytes(report.peak_rss_bytes)} "
              f"(largest source shard {human_bytes(report.largest_shard_bytes)})")


@app.command()
@friendly
def inspect(
    artifact: Annotated[Path, typer.Argument(help="The .nfer file.")],
    verify: Annotated[bool, typer.Option("--verify", help="Recompute checksums and re-decode every tensor.")] = False,
    objects: Annotated[bool, typer.Option("--objects", help="List every object.")] = False,
    as_json: JsonOpt = False,
):
    """Check an artifact and say whether this build can run it, and with which features."""
    from rich.markup import escape

    from format.container import open_artifact
    from format.errors import ArtifactError
    from format.inspect import summarize, verify as deep_verify

    from format.upstream import UpstreamArtifactError

    try:
        art = open_artifact(artifact)
    except UpstreamArtifactError as exc:
        _print_upstream({**exc.info.as_dict(), "runnable": False, "problems": [exc.reason]}, as_json)
        raise typer.Exit(1)
    except ArtifactError as exc:
        if as_json:
            print(json.dumps({"path": str(artifact), "runnable": False, "problems": [str(exc)]}))
        else:
            out.print(f"{escape(str(artifact))}: [red]cannot run[/red]: {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(1)
    with art:
        s = summarize(art)
        if verify:
            s["verify_failures"] = deep_verify(art)
            s["runnable"] = s["runnable"] and not s["verify_failures"]
            if not s["checksums"]:  # v2 (or a v3 written without them): decoding finds only some corruption
                s["verify_note"] = ("this artifact carries no checksums (version 2 has none): --verify can only find "
                                    "corruption that makes a tensor undecodable, not flipped bits in its codes")
        if objects:
            s["object_list"] = [{"name": e.name, "kind": e.kind, "component": e.component, "format": e.format or "-",
                                 "shape": list(e.shape), "offset": e.offset, "bytes": e.nbytes}
                                for e in art.objects.values()]
    if as_json:
        print(json.dumps(s))
    else:
        _print_inspect(s)
    raise typer.Exit(0 if s["runnable"] else 1)


def _print_inspect(s: dict) -> None:
    """Artifact data is printed without markup or escaped: a model_id like "[/x]" prints as itself."""
    from rich.markup import escape
    from rich.table import Table

    out.print(f"{s['path']}: magic {s['magic']}  version {s['version']}  {human_bytes(s['file_bytes'])}", markup=False)
    if s["origin"] != "ninfer":
        out.print(f"origin: {s['origin']} (model {s['upstream_model_id'] or 'unknown'}, weights {s['weights_profile'] or 'unknown'}; components "
                  f"{', '.join(s['upstream_components'])}), bound to this build's names and layouts", markup=False)
        for note in s["binding_notes"][:3]:
            out.print(f"  {note}", markup=False)
        if len(s["binding_notes"]) > 3:
            out.print(f"  ... and {len(s['binding_notes']) - 3} more like these", markup=False)
    out.print(f"identity: model_id={s['identity']['model_id']} weights_id={s['identity']['weights_id']}"
              + (f"  artifact_id={s['artifact_id']}" if s["artifact_id"] else ""), markup=False)
    if s["model"]:
        m = s["model"]
        out.print(f"model: {m['model_type']}, {m['layers']} layers ({m['full_attention_layers']} full attention), "
                  f"hidden {m['hidden']}, vocab {m['vocab']}" + (f", {m['experts']} experts" if m["experts"] else "")
                  + (f", MTP {m['mtp_layers']} layer(s)" if m["mtp_layers"] else ""), markup=False)
        if m.get("dflash2"):
            d = m["dflash2"]
            out.print(f"DFlash2 drafter: {d['layers']} layers, taps target layers {d['target_layer_ids']}, window "
                      f"{d['sliding_window']}, block {d['block_size']}, top-{d['selector_top_k']} selector", markup=False)
    out.print(f"components: {', '.join(s['components'])}; {s['objects']} objects, {s['checksums']} with sha256", markup=False)
    table = Table("format", "objects", "bytes", box=None)
    for fmt, v in sorted(s["by_format"].items()):
        table.add_row(escape(fmt), str(v["objects"]), human_bytes(v["bytes"]))
    out.print(table)
    for o in s.get("object_list", []):
        out.print(f"  {o['name']:<56} {o['format']:<11} {str(o['shape']):<16} {o['bytes']:>12}", markup=False)
    for f in s.get("verify_failures", []):
        out.print(f"[red]verify:[/red] {escape(f)}")
    if "verify_failures" in s and not s["verify_failures"]:
        out.print("verify: every checksum and every tensor decodes cleanly" if s["checksums"]
                  else "verify: every tensor decodes cleanly")
    if s.get("verify_note"):
        out.print(f"[yellow]note:[/yellow] {escape(s['verify_note'])}", soft_wrap=True)
    if s["runnable"]:
        out.print(f"[green]verdict: runnable[/green] — {escape('; '.join(s['features']))}")
    else:
        reason = s["problems"][0] if s["problems"] else "verification failed"
        out.print(f"[red]verdict: cannot run[/red] — {escape(reason)}", soft_wrap=True)
    for comp, why in s["companions"].items():
        out.print(f"  {comp}: {why}", markup=False)


class KvDtype(str, Enum):
    bf16 = "bf16"
    int8 = "int8"
    fp8 = "fp8"
    nvfp4 = "nvfp4"
    k8v4 = "k8v4"
    rk8v4 = "rk8v4"
    rk4v4 = "rk4v4"
    rk4v4_e8 = "rk4v4-e8"
    rk2v4_e8 = "rk2v4-e8"


class Spec(str, Enum):
    none = "none"
    mtp = "mtp"
    dflash2 = "dflash2"


@app.command()
@friendly
def fit(
    artifact: Annotated[Optional[Path], typer.Argument(help="The .nfer file (omit with --shape).")] = None,
    shape: Annotated[Optional[str], typer.Option(help="A full-size shape instead of a file: qwen3.6-27b, qwen3.8-27b, qwen3.6-35b-a3b (no download, no GPU).")] = None,
    recipe: Annotated[str, typer.Option(help="Weight recipe of the --shape model (q4, q5, q6, w8, bf16), or an upstream profile as it binds (groupwise-int, nvfp4).")] = "q4",
    vision_recipe: Annotated[str, typer.Option(help="The --shape model's vision matrices with --vision: bf16, w8 or q6.")] = "bf16",
    vram: Annotated[Optional[str], typer.Option(help="Card memory, e.g. 24G (GiB), 80GB (10^9).")] = None,
    gpu: Annotated[Optional[str], typer.Option(help="A known card instead of --vram: rtx4090, rtx5090, h100, h200, ...")] = None,
    vram_reserve: Annotated[str, typer.Option(help="Memory left unplanned (CUDA context, other processes).")] = "1.3G",
    kv_dtype: Annotated[KvDtype, typer.Option(help="KV-cache codec.")] = KvDtype.bf16,
    max_concurrency: Annotated[int, typer.Option(min=1, max=8, help="Lanes (concurrent requests).")] = 1,
    prefill_chunk: PrefillChunkOpt = "auto",
    spec: Annotated[Spec, typer.Option(help="Speculative decoding backend.")] = Spec.none,
    draft_tokens: Annotated[int, typer.Option(help="Draft tokens per round (1..15).")] = 3,
    lm_head_draft: Annotated[bool, typer.Option("--lm-head-draft", help="Keep the reduced draft head resident.")] = False,
    vision: Annotated[bool, typer.Option("--vision", help="Keep the vision tower and its workspace resident.")] = False,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs/--no-cuda-graphs", help="Count CUDA-graph pools.")] = True,
    max_context: Annotated[Optional[int], typer.Option(help="Check this context instead of solving for the largest.")] = None,
    as_json: JsonOpt = False,
):
    """Solve for the largest --max-context that fits a card, byte for byte (no GPU needed)."""
    import tempfile

    from format.container import open_artifact
    from runtime.memory_plan import (GPU_VRAM_MIB, NATIVE_CONTEXT, MemoryPlanError, PlanOptions, build_plan, fit as solve,
                                     parse_bytes, parse_prefill_chunk, resolve_prefill_chunk, weight_cache_fit,
                                     weight_cache_reserve)

    if (vram is None) == (gpu is None):
        raise MemoryPlanError("give exactly one of --vram SIZE or --gpu NAME")
    if gpu is not None:
        key = gpu.lower().replace(" ", "").replace("_", "")
        if key not in GPU_VRAM_MIB:
            raise MemoryPlanError(f"unknown --gpu {gpu!r}; known: {', '.join(GPU_VRAM_MIB)} (or pass --vram)")
        total = GPU_VRAM_MIB[key] << 20
    else:
        total = parse_bytes(vram)
    reserve = parse_bytes(vram_reserve)
    if (artifact is None) == (shape is None):
        raise MemoryPlanError("give exactly one of ARTIFACT or --shape NAME")
    if shape is not None:  # a zero-payload artifact of the shape (a few KB of disk), with what the options ask for
        from format.shapes import write_shape_artifact

        workdir = tempfile.TemporaryDirectory(prefix="ninfer-fit-")
        artifact = write_shape_artifact(shape, Path(workdir.name) / f"{shape}-{recipe}.nfer", recipe, mtp=True,
                                        lm_head_draft=32768 if lm_head_draft else 0, dflash2=spec == Spec.dflash2,
                                        vision=vision, vision_recipe=vision_recipe)
    opts = PlanOptions(max_context=max_context or 64, max_concurrency=max_concurrency, kv_dtype=kv_dtype.value,
                       prefill_chunk=parse_prefill_chunk(prefill_chunk), spec=spec.value, draft_tokens=draft_tokens,
                       lm_head_draft=lm_head_draft, vision=vision, cuda_graphs=cuda_graphs)
    with open_artifact(artifact) as art:
        opts = resolve_prefill_chunk(art, opts, total)
        if max_context is not None:
            plan = build_plan(art, opts)
            best = solve(art, opts, total, reserve)
            fits = plan.total_bytes <= total - reserve
        else:
            best = solve(art, opts, total, reserve)
            plan, fits = best.plan, best.max_context > 0
        budget = total - reserve
        # what the engine's weight cache would keep in the memory this plan leaves spare
        cache = weight_cache_fit(art, budget - plan.total_bytes - weight_cache_reserve(total)) if plan and fits else (0, 0, 0)
    result = {
        "vram_bytes": total, "reserve_bytes": reserve, "budget_bytes": budget,
        "max_context": best.max_context, "requested_context": max_context, "fits": fits,
        "kv_dtype": kv_dtype.value, "max_concurrency": max_concurrency, "spec": spec.value,
        "prefill_chunk": opts.prefill_chunk, "kv_bytes_per_token": plan.kv_bytes_per_token if plan else None,
        "total_bytes": plan.total_bytes if plan else best.fixed_bytes,
        "breakdown": plan.breakdown() if plan else {}, "bytes_per_64_tokens": best.bytes_per_page_group,
        "capped_by_model": best.max_context == NATIVE_CONTEXT,
        "weight_cache": {"products": cache[0], "of_products": cache[1], "bytes": cache[2]},
    }
    if as_json:
        print(json.dumps(result))
    else:
        _print_fit(result)
    raise typer.Exit(0 if fits else 1)


def _print_fit(r: dict) -> None:
    from rich.table import Table

    table = Table("region", "bytes", "", box=None)
    for name, n in r["breakdown"].items():
        table.add_row(name, f"{n:,}", human_bytes(n))
    table.add_row("total", f"{r['total_bytes']:,}", human_bytes(r["total_bytes"]))
    table.add_row("budget", f"{r['budget_bytes']:,}", f"{human_bytes(r['vram_bytes'])} - {human_bytes(r['reserve_bytes'])} reserve")
    if r["breakdown"]:
        out.print(table)
    if r["requested_context"] is not None:
        verdict = "fits" if r["fits"] else f"does NOT fit ({r['total_bytes'] - r['budget_bytes']:,} bytes short)"
        out.print(f"--max-context {r['requested_context']} {verdict}; largest that fits: {r['max_context']}")
    elif r["fits"]:
        capped = ""
        if r["capped_by_model"]:  # the model's own limit, not memory, decided it
            capped = f" = the model's maximum; {human_bytes(r['budget_bytes'] - r['total_bytes'])} to spare"
        out.print(f"max context: {r['max_context']:,} tokens{capped} ({r['kv_dtype']} KV, {r['kv_bytes_per_token']:,} "
                  f"B/token, {r['max_concurrency']} lane(s), spec {r['spec']}, prefill chunk {r['prefill_chunk']})")
    else:
        out.print(f"[red]nothing fits[/red]: even 64 tokens need {human_bytes(r['total_bytes'])} of a "
                  f"{human_bytes(r['budget_bytes'])} budget")
    cache = r["weight_cache"]
    if cache["products"]:
        out.print(f"weight cache: dense copies of {cache['products']} of {cache['of_products']} layer products "
                  f"({human_bytes(cache['bytes'])}) in the memory left spare: faster prefill (--weight-cache off frees it)")


class Runtime(str, Enum):
    reference = "reference"
    triton = "triton"


@app.command()
@friendly
def generate(
    artifact: Annotated[Path, typer.Argument(help="The .nfer file.")],
    prompt: Annotated[str, typer.Option(help="User message (chat template applied) or raw text with --raw.")] = "Hello",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 32,
    raw: Annotated[bool, typer.Option("--raw", help="Tokenize the prompt as is, without the chat template.")] = False,
    raw_output: Annotated[bool, typer.Option("--raw-output", help="Print the generated text as is (default: control characters escaped).")] = False,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    runtime: Annotated[Runtime, typer.Option(help="reference (plain torch) or triton (paged KV, kernels, graphs).")] = Runtime.reference,
    kv_dtype: Annotated[KvDtype, typer.Option(help="KV-cache codec (triton runtime).")] = KvDtype.bf16,
    max_context: Annotated[int, typer.Option(help="Context the triton runtime plans memory for.")] = 4096,
    prefill_chunk: PrefillChunkOpt = "auto",
    weight_cache: WeightCacheOpt = WeightCache.auto,
    temperature: Annotated[float, typer.Option(help="0 = greedy (triton runtime samples on the device).")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus mass to keep.")] = 1.0,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min_p x the top probability.")] = 0.0,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed.")] = None,
    spec: Annotated[Spec, typer.Option(help="Speculative decoding (triton runtime): mtp drafts from the MTP head, dflash2 from the DFlash2 drafter.")] = Spec.none,
    draft_tokens: Annotated[int, typer.Option(help="Draft tokens per speculative round (1..15).")] = 3,
    lm_head_draft: Annotated[bool, typer.Option("--lm-head-draft", help="Draft with the reduced frequency-ranked head.")] = False,
    draft_vocab: Annotated[int, typer.Option(min=0, help="Draft from the output head's first N token ids only (a view: no memory; cheaper drafting, drafts outside those ids never proposed; 0 = the whole head).")] = 0,
    vision: Annotated[bool, typer.Option("--vision", help="Load the vision tower (needed for --image).")] = False,
    image: Annotated[Optional[list[Path]], typer.Option(help="An image file placed before the prompt (repeatable; needs --vision).")] = None,
    verify_weights: VerifyWeightsOpt = False,
    as_json: JsonOpt = False,
):
    """Generate with the reference runtime (greedy) or the Triton runtime (greedy or sampled)."""
    import time

    if verify_weights:
        _verify_weights(artifact)
    prepare_device(device)
    from runtime.generate import TextSession

    options = params = None
    if runtime == Runtime.triton:
        from runtime.kernels.sampling import SamplingParams
        from runtime.memory_plan import PlanOptions, parse_prefill_chunk

        options = PlanOptions(max_context=max_context, kv_dtype=kv_dtype.value, prefill_chunk=parse_prefill_chunk(prefill_chunk),
                              spec=spec.value, draft_tokens=draft_tokens, lm_head_draft=lm_head_draft, vision=vision,
                              weight_cache=weight_cache.value, draft_vocab=draft_vocab)
        if temperature > 0:
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    elif temperature > 0 or spec != Spec.none:
        from runtime.memory_plan import MemoryPlanError

        raise MemoryPlanError("sampling or --spec needs --runtime triton; the reference runtime is plain greedy")
    if image and not vision:
        from runtime.memory_plan import MemoryPlanError

        raise MemoryPlanError("--image needs --vision")
    session = TextSession.load(artifact, device, options, vision=vision)
    t0 = time.monotonic()
    result = session.complete(prompt, max_new_tokens, chat=not raw, params=params, seed=seed,
                              image_files=tuple(image or ()))
    dt = time.monotonic() - t0
    speculator = getattr(session.model, "speculator", None)
    stats = speculator.stats.as_dict() if speculator is not None and speculator.stats.rounds else None
    if as_json:
        print(json.dumps({**result, "seconds": round(dt, 3)} | ({"spec_stats": stats} if stats else {})))
        return
    print(result["text"] if raw_output else printable(result["text"]))
    err.print(f"{result['prompt_tokens']} prompt + {len(result['tokens'])} new tokens in {dt:.2f} s on {device} "
              f"({runtime.value} runtime)")
    if stats:
        err.print(f"{spec.value}: {stats['rounds']} rounds, acceptance {stats['acceptance']:.1%}, "
                  f"{stats['tokens_per_round']:.2f} tokens/round")


@app.command()
@friendly
def bench(
    artifact: Annotated[Optional[Path], typer.Argument(help="The .nfer file (omit with --random-weights).")] = None,
    random_weights: Annotated[Optional[str], typer.Option(help="Benchmark a full-size shape with random weights made on the GPU: qwen3.6-27b, qwen3.6-35b-a3b.")] = None,
    recipe: Annotated[str, typer.Option(help="Weight recipe of the --random-weights artifact (q4, q5, q6, w8, bf16), or an upstream profile as it binds (groupwise-int, nvfp4).")] = "q4",
    depths: Annotated[str, typer.Option(help="Context depths, e.g. 8k,32k,200k.")] = "8k,32k",
    kv_dtype: Annotated[str, typer.Option(help="Comma-separated KV codecs, e.g. bf16,int8,rk4v4-e8.")] = "bf16",
    decode_tokens: Annotated[int, typer.Option(min=2, help="Tokens decoded at each depth.")] = 64,
    spec: Annotated[Spec, typer.Option(help="Speculative decoding backend.")] = Spec.none,
    draft_tokens: Annotated[int, typer.Option(help="Draft tokens per round (1..15).")] = 3,
    accepted_drafts: Annotated[Optional[int], typer.Option(help="Force this many accepted drafts per round (random weights have no real acceptance).")] = None,
    lm_head_draft: Annotated[bool, typer.Option("--lm-head-draft", help="Draft with the reduced head.")] = False,
    draft_vocab: Annotated[int, typer.Option(min=0, help="Draft from the output head's first N token ids only (a view: no memory; cheaper drafting, drafts outside those ids never proposed; 0 = the whole head).")] = 0,
    prefill_chunk: PrefillChunkOpt = "auto",
    prefill_limit: Annotated[str, typer.Option(help="Deeper contexts are synthetic (decode timing only).")] = "256k",
    lanes: Annotated[Optional[str], typer.Option(help="Lanes mode: decode with each lane count at once, e.g. 1,2,4,8 (at the first --depths entry per lane); with --spec, batched speculative rounds too.")] = None,
    concurrent_prefill: Annotated[Optional[str], typer.Option(help="Lanes mode: lane 0 also prefills this many tokens while the other lanes decode (inter-token gaps), e.g. 32k.")] = None,
    distinct_lane_tokens: Annotated[bool, typer.Option("--distinct-lane-tokens", help="Lanes mode: each lane feeds its own token, so a MoE routes the lanes apart as independent requests would (default: one token for all, the lanes share their experts).")] = False,
    kernels: Annotated[Optional[str], typer.Option(help="Kernels mode: every distinct quantized product of the model at these row counts of x, e.g. 1,2,4,8 (microseconds, fraction of copy bandwidth).")] = None,
    plot_png: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of tok/s vs depth (or vs lanes).")] = None,
    json_out: Annotated[Optional[Path], typer.Option(help="Also write the results JSON to this file.")] = None,
    as_json: JsonOpt = False,
):
    """Prefill and decode speed per depth against the bandwidth roofline, decode with several lanes at
    once (--lanes) against one weight read per step, or each quantized product alone (--kernels) against
    the copy bandwidth (needs a CUDA GPU)."""
    import tempfile

    import torch

    from runtime.bench import BenchOptions, plot, plot_lanes, run_bench, run_kernel_bench, run_lanes_bench
    from runtime.memory_plan import MemoryPlanError, parse_prefill_chunk

    if not torch.cuda.is_available():
        raise MemoryPlanError("ninfer bench measures GPU speed and needs a CUDA GPU; use `ninfer fit` for memory on CPU")
    if (artifact is None) == (random_weights is None):
        raise MemoryPlanError("give exactly one of ARTIFACT or --random-weights SHAPE")
    if accepted_drafts is not None and not 0 <= accepted_drafts <= draft_tokens:
        raise MemoryPlanError(f"--accepted-drafts must be in 0..{draft_tokens} (--draft-tokens)")
    lane_counts = _lane_counts(lanes) if lanes else None
    if concurrent_prefill and not lane_counts:
        raise MemoryPlanError("--concurrent-prefill needs --lanes (e.g. --lanes 1,4 --concurrent-prefill 32k)")
    if concurrent_prefill and spec != Spec.none:
        raise MemoryPlanError("--concurrent-prefill measures plain decoding lanes; drop --spec")
    row_counts = _row_counts(kernels) if kernels else None
    if row_counts and lane_counts:
        raise MemoryPlanError("give one of --lanes and --kernels")
    seed = None
    if random_weights is not None:
        from format.shapes import write_shape_artifact

        workdir = Path(tempfile.mkdtemp(prefix="ninfer-bench-"))
        artifact = write_shape_artifact(random_weights, workdir / f"{random_weights}-{recipe}.nfer", recipe,
                                        mtp=True, lm_head_draft=32768 if lm_head_draft else 0,
                                        dflash2=spec == Spec.dflash2)
        seed = 0
    if row_counts:
        results = run_kernel_bench(artifact, row_counts, log=lambda m: err.print(m))
        plotter, printer = None, _print_kernels
    elif lane_counts:
        results = run_lanes_bench(artifact, lane_counts, _tokens(depths.split(",")[0]), kv_dtype.split(","),
                                  prefill_tokens=_tokens(concurrent_prefill) if concurrent_prefill else 0,
                                  prefill_chunk=parse_prefill_chunk(prefill_chunk), random_weights_seed=seed,
                                  spec=spec.value, draft_tokens=draft_tokens, accepted_drafts=accepted_drafts,
                                  lm_head_draft=lm_head_draft, draft_vocab=draft_vocab,
                                  distinct_tokens=distinct_lane_tokens, log=lambda m: err.print(m))
        plotter, printer = plot_lanes, _print_lanes
    else:
        opts = BenchOptions(depths=[_tokens(d) for d in depths.split(",")], kv_dtypes=kv_dtype.split(","),
                            decode_tokens=decode_tokens, spec=spec.value, draft_tokens=draft_tokens,
                            accepted_drafts=accepted_drafts, lm_head_draft=lm_head_draft, draft_vocab=draft_vocab,
                            prefill_chunk=parse_prefill_chunk(prefill_chunk), prefill_limit=_tokens(prefill_limit),
                            random_weights_seed=seed)
        results = run_bench(artifact, opts, log=lambda m: err.print(m))
        plotter, printer = plot, _print_bench
    if random_weights is not None:
        results["shape"], results["recipe"] = random_weights, recipe
    if json_out:
        json_out.write_text(json.dumps(results, indent=1))
    if plot_png and plotter is None:
        err.print("--plot: the kernels mode has no plot; its table and --json-out hold the numbers")
    elif plot_png and not plotter(results, plot_png):
        err.print("--plot skipped: matplotlib is not installed (pip install matplotlib)")
    if as_json:
        print(json.dumps(results))
        return
    printer(results)


def _print_upstream(d: dict, as_json: bool) -> None:
    """inspect on an upstream ninfer artifact this build cannot bind: what it is and holds, and why."""
    from rich.markup import escape

    if as_json:
        print(json.dumps(d))
        return
    out.print(f"{escape(d['path'])}: [bold]upstream ninfer v{d['version']}[/bold] artifact, model "
              f"{escape(str(d['model_id']))}, weights {escape(str(d['weights_profile']))}, {d['objects']} objects",
              soft_wrap=True)
    out.print(f"  components: {escape(', '.join(d['components']) or '-')}", soft_wrap=True)
    out.print(f"  weight formats: {escape(', '.join(d['formats']) or '-')}", soft_wrap=True)
    if d["resources"]:
        out.print(f"  resources: {escape(', '.join(d['resources']))}", soft_wrap=True)
    out.print("  [red]cannot run[/red] in this build:", soft_wrap=True)
    for why in d["problems"]:
        out.print(f"  - {escape(why)}", soft_wrap=True)
    out.print("  to run this model now: use its groupwise-int artifact, or `ninfer convert` its Hugging Face "
              "checkpoint", soft_wrap=True)


def _kv_capacity_options(artifact, options, kv_capacity: str, vram_reserve: str, device: str):
    """--kv-capacity N: N tokens shared by the lanes (per-lane context N // lanes); auto: the largest
    per-lane context the plan fits into this GPU's free memory minus --vram-reserve."""
    from dataclasses import replace

    from format.container import open_artifact
    from runtime.memory_plan import MemoryPlanError, fit as solve, parse_bytes, resolve_prefill_chunk

    lanes = options.max_concurrency
    if kv_capacity.strip().lower() != "auto":
        total = _tokens(kv_capacity)
        if total < lanes:
            raise MemoryPlanError(f"--kv-capacity {kv_capacity} leaves no tokens for {lanes} lane(s)")
        return replace(options, max_context=min(total // lanes, 262_144))
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise MemoryPlanError("--kv-capacity auto sizes the cache from free GPU memory; give a number on CPU")
    free, card = torch.cuda.mem_get_info()
    with open_artifact(artifact) as art:
        options = resolve_prefill_chunk(art, options, card)
        best = solve(art, options, free, parse_bytes(vram_reserve))
    if best.max_context == 0:
        raise MemoryPlanError("nothing fits the free GPU memory; lower --max-concurrency or pick a smaller --kv-dtype")
    return replace(options, max_context=best.max_context)


def _tokens(text: str) -> int:
    from runtime.memory_plan import MemoryPlanError

    t = text.strip().lower()
    try:
        return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    except ValueError:
        raise MemoryPlanError(f"cannot read a token count from {text!r}; write e.g. 8k, 32768 or 200k") from None


def _counts(text: str, option: str, what: str, top: int) -> list[int]:
    """A comma-separated list of counts for `option` (sorted, unique, 1..top), or a one-line error."""
    from runtime.memory_plan import MemoryPlanError

    try:
        counts = sorted({int(v) for v in text.split(",")})
    except ValueError:
        raise MemoryPlanError(f"{option} {text!r}: give {what} counts such as 1,2,4,8") from None
    if not counts or counts[0] < 1 or counts[-1] > top:
        raise MemoryPlanError(f"{option} {text!r}: {what} counts must be 1..{top}")
    return counts


def _lane_counts(text: str) -> list[int]:
    return _counts(text, "--lanes", "lane", 8)


def _row_counts(text: str) -> list[int]:
    return _counts(text, "--kernels", "row", 4096)


def _print_kernels(r: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    counts = r["row_counts"]
    t = Table(title=f"{escape(r['artifact'])} on {escape(r['device'])}: each product alone, µs (of copy; x the "
                    f"one-row product) (copy {r['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s)")
    for col in ("matrix", "format", "N x K", "per step", *[f"T = {c}" for c in counts]):
        t.add_column(col, justify="right", no_wrap=True)
    for row in r["rows"]:
        cells = []
        for c in counts:
            cell = f"{row[f't{c}_us']:.1f} ({row[f't{c}_of_copy']:.2f}"
            cell += f"; x{row[f't{c}_vs_t1']:.2f})" if c != 1 and f"t{c}_vs_t1" in row else ")"
            cells.append(cell)
        t.add_row(escape(row["matrix"]), row["format"], f"{row['N']} x {row['K']}", str(row["per_step"]), *cells)
    out.print(t)


def _print_lanes(r: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    apart = ", each lane its own token" if r.get("lane_tokens") == "distinct" else ""
    t = Table(title=f"{escape(r['artifact'])} on {escape(r['device'])}, {r['depth']} tokens per lane{apart} "
                    f"(copy {r['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s)")
    for col in ("KV", "lanes", "step ms", "x one lane", "aggregate tok/s", "per lane tok/s", "ideal tok/s", "of ideal"):
        t.add_column(col, justify="right", no_wrap=True)
    for row in r["rows"]:
        t.add_row(row["kv_dtype"], str(row["lanes"]), f"{row['step_ms']:.2f}", f"{row['step_vs_one_lane']:.2f}",
                  f"{row['aggregate_tok_s']:.0f}", f"{row['per_lane_tok_s']:.1f}",
                  f"{row.get('ideal_aggregate_tok_s', 0):.0f}", f"{row.get('of_ideal', 0):.2f}")
    out.print(t)
    if r.get("spec", "none") != "none":
        forced = r.get("accepted_drafts")
        t = Table(title=f"batched {escape(r['spec'])} rounds, {r['draft_tokens']} drafts per lane"
                        + (f", {forced} accepted (forced)" if forced is not None else ""))
        for col in ("KV", "lanes", "round ms", "x plain step", "drafts ms", "verify ms", "verify x step",
                    "tokens per lane and round", "per lane tok/s", "aggregate tok/s", "x plain", "of one lane's x"):
            t.add_column(col, justify="right", no_wrap=True)
        for row in r["rows"]:
            t.add_row(row["kv_dtype"], str(row["lanes"]), f"{row['spec_round_ms']:.2f}", f"{row['spec_round_vs_step']:.2f}",
                      f"{row.get('spec_draft_ms', 0):.2f}", f"{row.get('spec_verify_ms', 0):.2f}",
                      f"{row.get('spec_verify_vs_step', 0):.2f}",
                      f"{row['spec_tokens_per_lane_round']:.2f}", f"{row['spec_per_lane_tok_s']:.1f}",
                      f"{row['spec_aggregate_tok_s']:.0f}", f"{row['spec_vs_plain']:.2f}",
                      f"{row['spec_vs_plain_of_one_lane']:.2f}")
        out.print(t)
    if r.get("concurrent_prefill"):
        first = r["concurrent_prefill"][0]
        t = Table(title=f"lane 0 prefills {first['prefill_tokens']} tokens while {first['decoding_lanes']} lanes decode "
                        f"(plain step {first['plain_step_ms']:.1f} ms)")
        for col in ("KV", "schedule", "chunk", "gap p50 ms", "gap p99 ms", "x plain step", "prefill tok/s", "of alone"):
            t.add_column(col, justify="right", no_wrap=True)
        for c in r["concurrent_prefill"]:
            t.add_row(c["kv_dtype"], c["schedule"], str(c["prefill_chunk"]), f"{c['gap_p50_ms']:.1f}",
                      f"{c['gap_p99_ms']:.1f}", f"{c['gap_vs_plain_step']:.1f}", f"{c['prefill_with_decoders_tok_s']:.0f}",
                      f"{c['prefill_vs_alone']:.2f}")
        out.print(t)


def _verify_weights(artifact: Path) -> None:
    """--verify-weights: the artifact's checksums recomputed, with a progress bar; a mismatch is one line."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from format.container import open_artifact
    from format.inspect import verify_checksums

    with open_artifact(artifact) as art, Progress(TextColumn("verifying"), BarColumn(), DownloadColumn(), console=err,
                                             transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("verify", total=None)
        verify_checksums(art, lambda done, total: bar.update(task, completed=done, total=total))
    err.print("weights verified: every checksum matches")


def _print_bench(r: dict) -> None:
    from rich.table import Table

    t = Table(title=f"{r['artifact']} on {r['device']} (copy {r['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s)")
    for col in ("KV", "depth", "context", "chunk", "prefill tok/s", "decode tok/s", "roofline tok/s", "of roofline",
                "tokens/round", "peak GiB"):
        t.add_column(col, justify="right")
    for row in r["rows"]:
        st = row.get("spec_stats")
        t.add_row(row["kv_dtype"], str(row["depth"]), row["context"], str(row.get("prefill_chunk", "-")),
                  f"{row['prefill_tok_s']:.0f}" if row["prefill_tok_s"] else "-", f"{row['decode_tok_s']:.1f}",
                  f"{row.get('roofline_tok_s', 0):.1f}", f"{row.get('of_roofline', 0):.2f}",
                  f"{st['tokens_per_round']:.2f}" if st else "-",
                  f"{(row.get('peak_allocated_bytes', 0) - row.get('weight_cache_bytes', 0)) / 2**30:.2f}")
    cache = max((row.get("weight_cache_bytes", 0) for row in r["rows"]), default=0)
    if cache:
        t.caption = (f"peak without the {cache / 2**30:.1f} GiB of dense layer weights kept in memory the plan leaves "
                     "spare (prefill skips their dequantization; --weight-cache off)")
    forced = r.get("options", {}).get("accepted_drafts")
    if forced is not None:  # random weights: the acceptance is set, not measured
        t.caption = (t.caption + "; " if t.caption else "") + (
            f"drafts forced: {forced} accepted per round (--accepted-drafts); tok/s is the speed of the drafting "
            "and verification, not of a measured acceptance rate")
    out.print(t)


@app.command()
@friendly
def serve(
    artifact: Annotated[Path, typer.Argument(help="The .nfer file.")],
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    model_id: Annotated[Optional[str], typer.Option(help="Model name clients send (default: the file name).")] = None,
    device: Annotated[str, typer.Option(help="cuda or cpu (cpu runs the Triton interpreter: tests only).")] = "cuda",
    max_context: Annotated[str, typer.Option(help="Tokens per lane, or auto: the largest that fits the GPU's free memory (the fit solver; 8192 on CPU).")] = "auto",
    max_concurrency: Annotated[int, typer.Option(min=1, max=8, help="Lanes decoding together.")] = 1,
    max_pending_requests: Annotated[int, typer.Option(min=0, help="Waiting requests before 429 / 529.")] = 64,
    pending_timeout_ms: Annotated[int, typer.Option(min=0, help="Queue wait before 503 (0 = forever).")] = 0,
    kv_dtype: Annotated[KvDtype, typer.Option(help="KV-cache codec.")] = KvDtype.bf16,
    prefill_chunk: PrefillChunkOpt = "auto",
    weight_cache: WeightCacheOpt = WeightCache.auto,
    prefill_chunk_shared: Annotated[Optional[int], typer.Option(min=0, help="Prefill chunk while other lanes decode: their next token waits for it, and their rows ride inside it (0 = the full chunk; default: 512 where every layer product is in the weight cache, else 1024). Smaller: shorter waits, slower prefill (bench --lanes 1,4 --concurrent-prefill 32k compares).")] = None,
    kv_capacity: Annotated[Optional[str], typer.Option(help="KV tokens across all lanes, or 'auto' for the most that fit the GPU (overrides --max-context).")] = None,
    vram_reserve: Annotated[str, typer.Option(help="Memory --kv-capacity auto leaves unplanned.")] = "1.3G",
    spec: Annotated[Spec, typer.Option(help="Speculative decoding: mtp drafts with the MTP head, dflash2 with the DFlash2 drafter.")] = Spec.none,
    draft_tokens: Annotated[int, typer.Option(help="Draft tokens per speculative round (1..15).")] = 3,
    lm_head_draft: Annotated[bool, typer.Option("--lm-head-draft", help="Draft with the reduced frequency-ranked head.")] = False,
    draft_vocab: Annotated[int, typer.Option(min=0, help="Draft from the output head's first N token ids only (a view: no memory; cheaper drafting, drafts outside those ids never proposed; 0 = the whole head).")] = 0,
    vision: Annotated[bool, typer.Option("--vision", help="Accept image inputs (needs the vision tower).")] = False,
    allow_local_images: Annotated[Optional[Path], typer.Option("--allow-local-images", help="With --vision: accept image_url paths / file:// URLs under this directory (off by default).")] = None,
    allow_remote_images: Annotated[bool, typer.Option("--allow-remote-images", help="With --vision: fetch http(s) image URLs.")] = False,
    preserve_thinking: Annotated[bool, typer.Option("--preserve-thinking", help="Keep earlier turns' reasoning in the prompt.")] = False,
    api_key: Annotated[Optional[str], typer.Option(envvar="NINFER_API_KEY", show_envvar=True, help="Require this key (Bearer or x-api-key).")] = None,
    cors: Annotated[bool, typer.Option("--cors", help="Allow browser clients from any origin.")] = False,
    request_log_jsonl: Annotated[Optional[Path], typer.Option(help="Append one JSON line per finished request.")] = None,
    max_request_bytes: Annotated[int, typer.Option(min=1024, help="Largest request body accepted (413 beyond).")] = 8 << 20,
    served_model_name: Annotated[Optional[str], typer.Option(help="Other model names clients may ask for, comma-separated (e.g. the names an agent CLI sends).")] = None,
    accept_any_model: Annotated[bool, typer.Option("--accept-any-model", help="Answer whatever model name a client asks for.")] = False,
    reasoning_budget: Annotated[Optional[int], typer.Option(min=0, help="Default thinking budget in tokens: the server ends the thinking block itself after this many (requests override it: budget_tokens, reasoning_effort low/medium/high = 1024/4096/16384, thinking_budget).")] = None,
    shutdown_grace_s: Annotated[float, typer.Option(min=0, help="On SIGTERM / SIGINT: stop admitting, let running requests finish for this long, then cancel them and exit 0.")] = 30.0,
    warm_up: Annotated[bool, typer.Option("--warm-up/--no-warm-up", help="Before serving: capture every CUDA graph (each decode batch size, prompt piece, speculative round), compile the sampler's variants and build the grammar tokenizer. Left to first use, each stops every lane, for seconds where a shape compiles its kernels.")] = True,
    verify_weights: VerifyWeightsOpt = False,
):
    """OpenAI Chat Completions + Responses + Anthropic Messages server over the Triton runtime."""
    import uvicorn

    from runtime.memory_plan import MemoryPlanError

    # the port first: a taken one fails in a second, not after loading the weights
    sock = _bind(host, port)
    if verify_weights:
        _verify_weights(artifact)
    prepare_device(device)
    from runtime.memory_plan import PlanOptions, parse_prefill_chunk
    from runtime.serve.launch import build_server

    auto = max_context.strip().lower() == "auto"
    options = PlanOptions(max_context=8192 if auto else _tokens(max_context), max_concurrency=max_concurrency,
                          kv_dtype=kv_dtype.value, prefill_chunk=parse_prefill_chunk(prefill_chunk), spec=spec.value,
                          draft_tokens=draft_tokens, lm_head_draft=lm_head_draft, vision=vision,
                          shared_prefill_chunk=prefill_chunk_shared, weight_cache=weight_cache.value,
                          draft_vocab=draft_vocab)
    if kv_capacity is None and auto and device.startswith("cuda"):
        kv_capacity = "auto"  # the longest context that fits, as `ninfer fit` computes it
    if kv_capacity is not None:
        options = _kv_capacity_options(artifact, options, kv_capacity, vram_reserve, device)
    if allow_local_images is not None and not allow_local_images.is_dir():
        raise MemoryPlanError(f"--allow-local-images {allow_local_images}: not a directory; give the folder images may be read from")
    app, summary = build_server(artifact, options, device=device, model_id=model_id, api_key=api_key, cors=cors,
                                preserve_thinking=preserve_thinking, max_pending=max_pending_requests,
                                pending_timeout_ms=pending_timeout_ms,
                                request_log=str(request_log_jsonl) if request_log_jsonl else None,
                                allow_local_images=str(allow_local_images) if allow_local_images else None,
                                allow_remote_images=allow_remote_images, max_request_bytes=max_request_bytes,
                                on_fatal=_exit_after_fatal, reasoning_budget=reasoning_budget,
                                model_aliases=tuple(n.strip() for n in (served_model_name or "").split(",") if n.strip()),
                                accept_any_model=accept_any_model, warm_up=warm_up)
    err.print(summary)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_grace_s))
    import signal

    # uvicorn turns SIGTERM / SIGINT into a graceful shutdown (stop accepting, let running requests finish
    # for up to the grace, cancel the rest), then re-raises the signal into the handler it found: a quiet
    # one here, so a shutdown that went as planned exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    err.print("ninfer serve: shut down")


def _bind(host: str, port: int):
    """The listening socket, bound before anything slow happens; a taken port is one line."""
    import socket

    from runtime.memory_plan import MemoryPlanError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise MemoryPlanError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or stop the "
                              "process holding it") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _exit_after_fatal(exc: BaseException) -> None:
    """The generation worker died: say so once, let /health answer 503 for a moment, exit non-zero so a
    supervisor restarts the server (clients were already answered with errors)."""
    import threading

    err.print(f"[red]error:[/red] the generation worker stopped ({type(exc).__name__}); exiting for a restart")
    threading.Timer(1.0, os._exit, args=(70,)).start()


@app.command()
@friendly
def demo(
    workdir: Annotated[Optional[Path], typer.Option(help="Where to write the tiny checkpoint and artifact.")] = None,
    moe: Annotated[bool, typer.Option("--moe", help="Use the tiny MoE (qwen3_5_moe) shape.")] = False,
):
    """Create a tiny random Qwen3.5 model, convert it, inspect it and generate on CPU."""
    import tempfile

    from format.container import open_artifact
    from format.convert import ConvertOptions, convert_checkpoint
    from format.inspect import summarize
    from format.tiny import write_tiny_checkpoint
    from runtime.generate import TextSession

    root = workdir or Path(tempfile.mkdtemp(prefix="ninfer-demo-"))
    src = write_tiny_checkpoint(root / "tiny-checkpoint", moe=moe)
    err.print(f"1/4 tiny {'MoE' if moe else 'dense'} checkpoint written to {src}")
    art_path = root / "tiny-q4.nfer"
    rep = convert_checkpoint(src, art_path, ConvertOptions(version=3, recipe="q4"))
    err.print(f"2/4 converted to {art_path} ({human_bytes(rep.file_bytes)}, components {', '.join(rep.components)})")
    with open_artifact(art_path) as art:
        s = summarize(art)
    err.print(f"3/4 inspect: {'runnable' if s['runnable'] else 'NOT runnable: ' + s['problems'][0]}")
    session = TextSession.load(art_path, "cpu")
    result = session.complete("Tell me about ninfer.", 16, chat=True)
    err.print(f"4/4 generated {len(result['tokens'])} tokens (random weights, so the text is noise):")
    print(printable(result["text"]))
    if workdir is None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        err.print(f"removed {root} (pass --workdir DIR to keep the checkpoint and the artifact)")


def main() -> None:
    # text from an artifact or a model may hold characters the terminal's encoding cannot (a lone
    # surrogate from a JSON escape): replaced, never a UnicodeEncodeError
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    from rich.markup import escape

    from runtime.switches import SwitchError, report_environment_once

    try:
        report_environment_once()
    except SwitchError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        sys.exit(1)
    app()


if __name__ == "__main__":
    main()
