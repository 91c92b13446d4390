"""Tiny Qwen3.5-family checkpoints in Hugging Face layout, generated locally (demo and tests).

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a built-in corpus and
the weights are seeded random numbers in the exact key layout of the real checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from .model_config import DFlash2Config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
# ids of the vision placeholders in tiny tokenizers (special tokens come first, in this order)
TINY_VISION_IDS = {"vision_start_token_id": 7, "vision_end_token_id": 8, "image_token_id": 9}
CORPUS = [
    "ninfer runs one Qwen3.5 model on one GPU at its physical limit.",
    "The quick brown fox jumps over the lazy dog while the cache grows to two hundred thousand tokens.",
    "def add(a, b):\n    return a + b\n",
    "Long context, fast decode, exact memory planning, low-bit KV cache and speculative decoding.",
    "user: What is the capital of France? assistant: Paris is the capital of France.",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Berlin\"}}",
]
# A Qwen3.5-style template written for the tiny test models: system-first rule, a tools block,
# reasoning kept only after the last real user query (or always with preserve_thinking), qwen3_coder
# XML tool calls, grouped tool responses, and the thinking on/off generation prompt.
CHAT_TEMPLATE = """{%- if messages[0].role == 'system' %}{%- set system_text = messages[0].content | trim %}{%- set rest = messages[1:] %}
{%- else %}{%- set system_text = '' %}{%- set rest = messages %}{%- endif %}
{%- if tools %}
{{- '<|im_start|>system\n# Tools\n\nFunctions you may call:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nTo call one, reply with <tool_call>, then <function=NAME>, one <parameter=KEY> block per argument, and the closing tags.' }}
{%- if system_text %}{{- '\n\n' + system_text }}{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif system_text %}{{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' }}{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for m in rest %}{%- if m.role == 'user' %}{%- set c = m.content | trim %}
{%- if not (c.startswith('<tool_response>') and c.endswith('</tool_response>')) %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endif %}{%- endfor %}
{%- if ns.last_query < 0 %}{{- raise_exception('No user query found in messages.') }}{%- endif %}
{%- for m in rest %}
{%- if m.role == 'system' %}{{- raise_exception('System message must be at the beginning.') }}
{%- elif m.role == 'user' %}{{- '<|im_start|>user\n' + (m.content | trim) + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content or '' %}
{%- if m.reasoning_content is string %}{%- set reasoning = m.reasoning_content %}
{%- elif '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}{%- set content = content.split('</think>')[-1] %}
{%- else %}{%- set reasoning = '' %}{%- endif %}
{%- set content = content | trim %}
{%- if loop.index0 > ns.last_query or preserve_thinking %}
{{- '<|im_start|>assistant\n<think>\n' + (reasoning | trim) + '\n</think>\n\n' + content }}
{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}
{%- for call in m.tool_calls or [] %}
{%- if loop.first %}{%- if content %}{{- '\n\n' }}{%- endif %}{%- else %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n<function=' + call.function.name + '>\n' }}
{%- for key, value in call.function.arguments.items() %}
{{- '<parameter=' + key + '>\n' }}{%- if value is mapping or (value is sequence and value is not string) %}{{- value | tojson }}{%- else %}{{- value | string }}{%- endif %}{{- '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n' }}{%- if enable_thinking is defined and not enable_thinking %}{{- '\n</think>\n\n' }}{%- endif %}{%- endif %}"""


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def write_tokenizer(out: Path, vocab_size: int) -> dict:
    tok = build_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in ids.items()},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return ids


def tiny_text_config(moe: bool, vocab_size: int = 384, layers: int = 4, mtp_layers: int = 1, hidden: int = 64,
                     intermediate: int = 128, shared_intermediate: int = 48, head_dim: int = 64,
                     moe_intermediate: int = 32) -> dict:
    text = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": vocab_size, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [2 * head_dim // 64, head_dim // 64, head_dim // 64],
                            "mrope_interleaved": True},
        "mtp_num_hidden_layers": mtp_layers,
    }
    if moe:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=moe_intermediate,
                    shared_expert_intermediate_size=shared_intermediate)
    else:
        text.update(intermediate_size=intermediate)
    return text


def _layer_tensors(g, cfg: dict, prefix: str, full: bool, moe: bool) -> dict:
    import torch

    h, d = cfg["hidden_size"], cfg["head_dim"]

    def mat(rows, cols):
        return torch.randn(rows, cols, generator=g) * (1.0 / cols ** 0.5)

    def norm(n):
        return torch.randn(n, generator=g) * 0.1

    t = {f"{prefix}input_layernorm.weight": norm(h), f"{prefix}post_attention_layernorm.weight": norm(h)}
    if full:
        a = f"{prefix}self_attn."
        hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        t.update({f"{a}q_proj.weight": mat(hq * d * 2, h), f"{a}k_proj.weight": mat(hkv * d, h),
                  f"{a}v_proj.weight": mat(hkv * d, h), f"{a}o_proj.weight": mat(h, hq * d),
                  f"{a}q_norm.weight": norm(d), f"{a}k_norm.weight": norm(d)})
    else:
        la = f"{prefix}linear_attn."
        kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
        hv = cfg["linear_num_value_heads"]
        vd = hv * cfg["linear_value_head_dim"]
        t.update({f"{la}in_proj_qkv.weight": mat(2 * kd + vd, h), f"{la}in_proj_z.weight": mat(vd, h),
                  f"{la}in_proj_b.weight": mat(hv, h), f"{la}in_proj_a.weight": mat(hv, h),
                  f"{la}conv1d.weight": torch.randn(2 * kd + vd, 1, cfg["linear_conv_kernel_dim"], generator=g) * 0.5,
                  f"{la}A_log": torch.log(torch.rand(hv, generator=g) * 15 + 1),
                  f"{la}dt_bias": torch.ones(hv), f"{la}norm.weight": 1 + norm(cfg["linear_value_head_dim"]),
                  f"{la}out_proj.weight": mat(h, vd)})
    m = f"{prefix}mlp."
    if moe:
        e, i, s = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        t[f"{m}gate.weight"] = mat(e, h)
        t[f"{m}shared_expert_gate.weight"] = mat(1, h)
        for x in range(e):
            t.update({f"{m}experts.{x}.gate_proj.weight": mat(i, h), f"{m}experts.{x}.up_proj.weight": mat(i, h),
                      f"{m}experts.{x}.down_proj.weight": mat(h, i)})
        t.update({f"{m}shared_expert.gate_proj.weight": mat(s, h), f"{m}shared_expert.up_proj.weight": mat(s, h),
                  f"{m}shared_expert.down_proj.weight": mat(h, s)})
    else:
        i = cfg["intermediate_size"]
        t.update({f"{m}gate_proj.weight": mat(i, h), f"{m}up_proj.weight": mat(i, h), f"{m}down_proj.weight": mat(h, i)})
    return t


def write_tiny_checkpoint(out: str | Path, moe: bool = False, seed: int = 0, vocab_size: int = 384,
                          layers: int = 4, mtp_layers: int = 1, hidden: int = 64, intermediate: int = 128,
                          shared_intermediate: int = 48, head_dim: int = 64, moe_intermediate: int = 32) -> Path:
    """Write config.json, model.safetensors (bf16), tokenizer files and generation_config.json (`hidden` and
    `intermediate` widen the model, e.g. so its products reach the GPU kernels' shape rules; a MoE's shared
    expert is `shared_intermediate` wide, its routed experts `moe_intermediate`; `head_dim` 256 is the real
    models')."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, vocab_size)
    text = tiny_text_config(moe, vocab_size, layers, mtp_layers, hidden, intermediate, shared_intermediate, head_dim,
                            moe_intermediate)
    text["eos_token_id"] = ids["<|im_end|>"]
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
              "model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text, "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
    g = torch.Generator().manual_seed(seed)
    h, v = text["hidden_size"], vocab_size
    tensors = {"model.language_model.embed_tokens.weight": torch.randn(v, h, generator=g),
               "model.language_model.norm.weight": torch.randn(h, generator=g) * 0.1,
               "lm_head.weight": torch.randn(v, h, generator=g) * (1.0 / h ** 0.5)}
    for i in range(layers):
        full = text["layer_types"][i] == "full_attention"
        tensors.update(_layer_tensors(g, text, f"model.language_model.layers.{i}.", full, moe))
    if mtp_layers:
        tensors.update({"mtp.fc.weight": torch.randn(h, 2 * h, generator=g) * (1.0 / (2 * h) ** 0.5),
                        "mtp.pre_fc_norm_embedding.weight": torch.randn(h, generator=g) * 0.1,
                        "mtp.pre_fc_norm_hidden.weight": torch.randn(h, generator=g) * 0.1,
                        "mtp.norm.weight": torch.randn(h, generator=g) * 0.1})
        for j in range(mtp_layers):
            tensors.update(_layer_tensors(g, text, f"mtp.layers.{j}.", True, moe))
    save_file({k: t.to(torch.bfloat16).contiguous() for k, t in tensors.items()}, str(out / "model.safetensors"))
    return out


def tiny_dflash2_config(target_text: dict, layers: int = 2, window: int = 8, taps: tuple[int, ...] = (1, 3),
                        block_size: int = 4) -> DFlash2Config:
    """A DFlash2 drafter sized for a tiny target: the drafter shares its hidden width, embedding and head;
    a short sliding window so generation in tests wraps the context cache."""
    vocab = target_text["vocab_size"]
    return DFlash2Config(hidden_size=target_text["hidden_size"], intermediate_size=96, num_layers=layers, num_heads=4,
                         num_kv_heads=2, head_dim=16, vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=10000000.0,
                         sliding_window=window, block_size=block_size, mask_token_id=vocab - 1,
                         target_layer_ids=tuple(taps), conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                         selector_top_k=4)


def write_tiny_dflash2(out: str | Path, target_checkpoint: str | Path, seed: int = 0, **config_kw) -> Path:
    """A random DFlash2 drafter checkpoint (config.json + model.safetensors, bf16) for the tiny target in
    `target_checkpoint`, with the source key names of a real drafter."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_checkpoint) / "config.json").read_text())["text_config"]
    d = tiny_dflash2_config(target, **config_kw)
    (out / "config.json").write_text(json.dumps(d.to_hf_dict(), indent=2))
    g = torch.Generator().manual_seed(seed)
    h, hd, i = d.hidden_size, d.head_dim, d.intermediate_size
    hq, hkv = d.num_heads * hd, d.kv_rows

    def mat(rows, cols, scale=1.0):
        return torch.randn(rows, cols, generator=g) * (scale / cols ** 0.5)

    def norm(n):
        return 1 + torch.randn(n, generator=g) * 0.1  # plain RMSNorm weights (w, not 1 + w)

    rank, vocab, kernel, groups = d.selector_rank, d.vocab_size, d.conv_kernel_size, d.conv_groups
    t = {"fc.weight": mat(h, d.tap_width), "hidden_norm.weight": norm(h), "norm.weight": norm(h),
         "candidate_selector.hidden_projection.weight": mat(rank, h),
         "candidate_selector.predecessor_codebook": torch.randn(vocab, rank, generator=g),
         "candidate_selector.successor_codebook": torch.randn(vocab, rank, generator=g)}
    for j in range(d.num_layers):
        p = f"layers.{j}."
        t.update({p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
                  p + "self_attn.q_proj.weight": mat(hq, h), p + "self_attn.k_proj.weight": mat(hkv, h),
                  p + "self_attn.v_proj.weight": mat(hkv, h), p + "self_attn.o_proj.weight": mat(h, hq),
                  p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                  p + "mlp.gate_proj.weight": mat(i, h), p + "mlp.up_proj.weight": mat(i, h),
                  p + "mlp.down_proj.weight": mat(h, i)})
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.ones(2, kernel, h)
            base[:, 1:] = 0.3 * torch.randn(2, kernel - 1, h, generator=g)
            t[f"{p}{conv}.base_kernel"] = base
            t[f"{p}{conv}.kernel_projection.weight"] = mat(2 * kernel * groups, h, 0.2)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    return out
