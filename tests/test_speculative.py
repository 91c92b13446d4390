"""MTP speculative decoding on the tiny models: greedy output with speculation equals greedy output
without it, token for token, whatever the drafts; drafts that match are all accepted; the reduced
lm-head draft, MoE targets, stop tokens, budgets and prefix reuse keep that exactness."""

import pytest
import torch

pytest.importorskip("triton")

from format.convert import ConvertOptions, convert_checkpoint  # noqa: E402
from format.tiny import write_tiny_checkpoint  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.memory_plan import MemoryPlanError, PlanOptions  # noqa: E402

from .speculation import DEVICE, PROMPT, exact_only_on_cpu  # noqa: E402

NEW = 10


@pytest.fixture(scope="module")
def artifacts(tiny_with_mtp, tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    moe_src = write_tiny_checkpoint(d / "moe_src", moe=True, seed=5)
    return {
        "dense": convert_checkpoint(tiny_with_mtp, d / "dense.nfer", ConvertOptions(recipe="q4")).output,
        "draft-head": convert_checkpoint(tiny_with_mtp, d / "dh.nfer",
                                         ConvertOptions(recipe="w8", lm_head_draft=96)).output,
        "moe": convert_checkpoint(moe_src, d / "moe.nfer", ConvertOptions(recipe="q5")).output,
    }


def _engine(path, **kw):
    opts = dict(max_context=256, prefill_chunk=128)
    opts.update(kw)
    return Engine(path, PlanOptions(**opts), device=DEVICE)


def _plain(path, prompt=PROMPT, n=NEW, **kw):
    return _engine(path, **kw).generate(prompt, n)


@pytest.mark.parametrize("name,k,lm_head_draft", [("dense", 1, False), ("dense", 3, False), ("draft-head", 2, True),
                                                  ("moe", 2, False)])
@exact_only_on_cpu
def test_speculative_greedy_equals_plain_greedy(artifacts, name, k, lm_head_draft):
    path = artifacts[name]
    want = _plain(path)
    eng = _engine(path, spec="mtp", draft_tokens=k, lm_head_draft=lm_head_draft)
    assert eng.generate(PROMPT, NEW) == want
    s = eng.speculator.stats
    assert s.rounds >= 1 and s.drafted == s.rounds * k
    assert len(s.as_dict()["acceptance_by_position"]) == k


@pytest.fixture(scope="module")
def wide_mtp(tmp_path_factory):
    """A tiny model with MTP wide enough (hidden 512) that its W8 input projection [512, 1024] takes fragment order."""
    d = tmp_path_factory.mktemp("wide-mtp")
    src = write_tiny_checkpoint(d / "hf", seed=6, layers=2, mtp_layers=1, hidden=512, intermediate=1024)
    return convert_checkpoint(src, d / "wide-mtp.nfer", ConvertOptions(recipe="q4")).output


@exact_only_on_cpu
def test_w8_products_in_fragment_order_keep_speculative_greedy(wide_mtp, monkeypatch):
    """NINFER_FRAGMENT_W8=on (the default): a speculating engine of up to 8 rows a step lays out its W8 MTP input
    projection in byte order (the int8 fragment kernel's; on a CPU multiplied through the planes read back) and
    still generates plain greedy's tokens; off keeps the artifact's planes."""
    from runtime.kernels import qgemm_fragment_layout as fl

    want = _plain(wide_mtp)
    monkeypatch.setattr(fl, "FRAGMENT_W8", "on")
    eng = _engine(wide_mtp, spec="mtp", draft_tokens=2)
    fc = eng.lin["mtp/input_projection"].packed
    assert fc.fmt.bits == 8 and fc.fragment is not None and fc.fragment.order == "bytes"
    assert eng.generate(PROMPT, NEW) == want
    monkeypatch.setattr(fl, "FRAGMENT_W8", "off")
    assert _engine(wide_mtp, spec="mtp", draft_tokens=2).lin["mtp/input_projection"].packed.fragment is None


@pytest.mark.parametrize("spec_k", [1, 3])
@exact_only_on_cpu
def test_a_draft_vocabulary_keeps_greedy_output_and_drafts_inside_it(artifacts, spec_k):
    """--draft-vocab N: the drafter scores only the output head's first N rows (a view of its planes, no bytes
    of its own), so every draft is a token id below N; the output stays plain greedy's, token for token."""
    path = artifacts["dense"]
    want = _plain(path)
    eng = _engine(path, spec="mtp", draft_tokens=spec_k, draft_vocab=256)
    assert eng.draft_head.packed.base.data_ptr() == eng.lin["text/output_head"].packed.base.data_ptr()
    proposed = []
    real = eng.speculator.propose

    def spy(h):
        drafts = real(h)
        proposed.append(drafts.clone())
        return drafts

    eng.speculator.propose = spy
    assert eng.generate(PROMPT, NEW) == want
    assert proposed and all(int(d.max()) < 256 for d in proposed)
    assert eng.speculator.stats.drafted == eng.speculator.stats.rounds * spec_k


def test_a_draft_vocabulary_is_checked_where_it_is_given(artifacts):
    for kw, words in ((dict(draft_vocab=256), "needs --spec"), (dict(spec="mtp", draft_vocab=100), "256..384"),
                      (dict(spec="mtp", draft_vocab=1000), "256..384")):
        with pytest.raises(MemoryPlanError, match=words):
            _engine(artifacts["dense"], **kw)
    with pytest.raises(MemoryPlanError, match="give one"):
        _engine(artifacts["draft-head"], spec="mtp", draft_vocab=256, lm_head_draft=True)


@exact_only_on_cpu
def test_matching_drafts_are_all_accepted(artifacts, monkeypatch):
    """An oracle drafter that proposes the true greedy continuation: every draft is accepted, each
    round yields K+1 tokens, and the output is unchanged (exercises the no-rollback path)."""
    path, k = artifacts["dense"], 3
    want = _plain(path, n=13)
    eng = _engine(path, spec="mtp", draft_tokens=k)
    real_draft = eng.speculator._draft

    def oracle(lanes_t, tail_tokens, first, rows):
        real_draft(lanes_t, tail_tokens, first, rows)  # keep the MTP cache work identical
        done = len(eng.lane_tokens[0]) - len(PROMPT) + 1  # generated tokens so far (incl. the pending one)
        return torch.tensor([want[done : done + k] + [0] * k][:1], device=eng.device)[:, :k]

    monkeypatch.setattr(eng.speculator, "_draft", oracle)
    assert eng.generate(PROMPT, 13) == want
    s = eng.speculator.stats
    assert s.accepted == s.drafted == 3 * k
    assert s.as_dict()["tokens_per_round"] == k + 1
    assert s.accepted_at == [3] * k


@exact_only_on_cpu
def test_wrong_drafts_roll_back_exactly(artifacts, monkeypatch):
    """Drafts that are always wrong: every round rolls GDN state back to slot 1 and keeps one token."""
    path, k = artifacts["dense"], 4
    want = _plain(path)
    eng = _engine(path, spec="mtp", draft_tokens=k)
    real_draft = eng.speculator._draft
    vocab = eng.cfg.vocab_size

    def wrong(lanes_t, tail_tokens, first, rows):
        done = len(eng.lane_tokens[0]) - len(PROMPT) + 1
        d = real_draft(lanes_t, tail_tokens, first, rows)
        if done < len(want):
            d[:, 0] = (want[done] + 1) % vocab
        return d

    monkeypatch.setattr(eng.speculator, "_draft", wrong)
    assert eng.generate(PROMPT, NEW) == want
    assert eng.speculator.stats.accepted == 0


@exact_only_on_cpu
def test_stop_token_and_budget_inside_a_round(artifacts, monkeypatch):
    path, k = artifacts["dense"], 3
    want = _plain(path, n=13)
    stop = want[6]
    eng = _engine(path, spec="mtp", draft_tokens=k)
    got = eng.generate(PROMPT, 13, stop_ids=(stop,))
    assert got == want[: want.index(stop) + 1]
    assert _engine(path, spec="mtp", draft_tokens=k).generate(PROMPT, 5) == want[:5]


@exact_only_on_cpu
def test_prefix_reuse_with_speculation(artifacts):
    """A returning conversation continues from the lane (MTP cache included) and equals a fresh run."""
    path = artifacts["dense"]
    eng = _engine(path, spec="mtp", draft_tokens=2)
    first = eng.generate(PROMPT, 6)
    follow = PROMPT + first[:-1] + [first[-1], 21, 22, 23]
    assert eng.reusable_prefix(0, follow) == len(PROMPT) + len(first) - 1
    chunks = list(eng.prefill_chunks(0, follow, reuse=True))
    assert eng.stats.reused_tokens == len(PROMPT) + len(first) - 1
    fresh = _engine(path, spec="mtp", draft_tokens=2)
    want = fresh.prefill(0, follow)
    assert int(chunks[-1].argmax()) == int(want.argmax())


def test_speculation_needs_the_mtp_component(artifacts, tmp_path, hf_dense):
    plain = convert_checkpoint(hf_dense, tmp_path / "plain.nfer", ConvertOptions(recipe="q4")).output
    with pytest.raises(MemoryPlanError, match="mtp component"):
        _engine(plain, spec="mtp")
    with pytest.raises(MemoryPlanError, match="lm_head_draft component"):
        _engine(artifacts["dense"], spec="mtp", lm_head_draft=True)


@exact_only_on_cpu
def test_turn_checkpoint_with_speculation(artifacts):
    """Resuming at a turn checkpoint restores the MTP layer's pending row too: generation then equals
    a fresh lane's."""
    path = artifacts["dense"]
    eng = _engine(path, spec="mtp", draft_tokens=2)
    shared = PROMPT + [33, 44]
    list(eng.prefill_chunks(0, shared + [1, 2, 3], reuse=True, checkpoint_at=len(shared)))
    turn2 = shared + [1, 9, 9, 50]
    assert eng.reusable_prefix(0, turn2) == len(shared)
    logits = list(eng.prefill_chunks(0, turn2, reuse=True))[-1]
    first = int(logits.argmax())
    rest = []
    nxt = first
    while len(rest) < 6:
        new = eng.speculator.round([0], [nxt], [6 - len(rest)])[0]
        rest += new
        nxt = new[-1]
    assert [first] + rest == _plain(path, prompt=turn2, n=7)
