"""Our torch reference runtime against Hugging Face transformers' qwen3_5 / qwen3_5_moe."""

import pytest
import torch

from format.container import Artifact
from format.convert import ConvertOptions, convert_checkpoint
from runtime.model import ReferenceModel

PROMPT = [3, 17, 99, 150, 42, 7, 250, 11, 64, 300, 5, 128]
NEW_TOKENS = 20
# Relative RMS error of logits vs the bf16 oracle, per weight format family.
LOGIT_REL_RMS = {"w8": 0.03, "q6": 0.08}


def _hf(ckpt, kind):
    import transformers

    cls = transformers.Qwen3_5MoeForConditionalGeneration if kind == "moe" else transformers.Qwen3_5ForConditionalGeneration
    return cls.from_pretrained(ckpt, dtype=torch.float32).eval()


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                             min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def oracles(hf_checkpoints):
    return {k: _hf(v, k) for k, v in hf_checkpoints.items()}


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("version", [2, 3])
def test_greedy_tokens_match_transformers_on_bf16(hf_checkpoints, oracles, tmp_path, kind, version):
    art = convert_checkpoint(hf_checkpoints[kind], tmp_path / "m.nfer", ConvertOptions(version=version, recipe="bf16"))
    ours = ReferenceModel(Artifact(art.output))
    expected = _hf_greedy(oracles[kind], PROMPT, NEW_TOKENS)
    assert ours.generate(PROMPT, NEW_TOKENS) == expected
    with torch.no_grad():
        ref = oracles[kind](input_ids=torch.tensor([PROMPT])).logits[0]
    got = ours.forward(torch.tensor(PROMPT), ours.new_state(), 0)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("recipe", list(LOGIT_REL_RMS))
def test_quantized_logits_within_tolerance(hf_checkpoints, oracles, tmp_path, kind, recipe):
    art = convert_checkpoint(hf_checkpoints[kind], tmp_path / "q.nfer", ConvertOptions(recipe=recipe))
    ours = ReferenceModel(Artifact(art.output))
    with torch.no_grad():
        ref = oracles[kind](input_ids=torch.tensor([PROMPT])).logits[0]
    got = ours.forward(torch.tensor(PROMPT), ours.new_state(), 0)
    rel = ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert rel < LOGIT_REL_RMS[recipe], f"{recipe}: relative RMS error {rel:.4f}"


def test_incremental_decode_equals_full_prefill(hf_checkpoints, tmp_path):
    """Prefill in pieces (state carried) gives the same logits as one pass."""
    art = convert_checkpoint(hf_checkpoints["dense"], tmp_path / "m.nfer", ConvertOptions(recipe="bf16"))
    m = ReferenceModel(Artifact(art.output))
    full = m.forward(torch.tensor(PROMPT), m.new_state(), 0)
    st = m.new_state()
    a = m.forward(torch.tensor(PROMPT[:5]), st, 0)
    b = m.forward(torch.tensor(PROMPT[5:]), st, 5)
    assert torch.allclose(torch.cat([a, b]), full, atol=1e-5)
