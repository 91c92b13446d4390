"""Lane scheduler: a FIFO admission queue in front of the engine's 1..8 lanes.

One worker thread owns the engine. Each turn of its loop it admits waiting requests into free
lanes (first come, first served), runs one prefill chunk for every lane still prefilling — the
decoding lanes' next rows ride inside it, and it is --prefill-chunk-shared tokens long while they
do — then one batched decode step over every decoding lane that did not ride, so a long prompt
stalls the other lanes for at most a short chunk. Requests talk to the worker only through callbacks and flags.

Admission is bounded when a request arrives (running + queued <= lanes + max_pending). Whatever goes
wrong with one request (its admission, its sampling values, its callbacks) ends that request alone; an
error that escapes the loop itself answers every waiting client, marks the scheduler failed (health
503) and calls on_fatal. The worker also applies the decode-time controls a request carries: a
thinking budget (it emits the end-of-thinking token itself), banned and forced tokens (tool_choice),
an early end after the first tool call, per-token logprobs, and an answer grammar (structured output:
a JSON schema's token mask); such lanes take plain decode steps.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine import Riders
from ..kernels.sampling import SamplingParams, pick_token, pick_token_on_device
from ..switches import setting
from ..transfers import HostCopy


class QueueFull(RuntimeError):
    """Running plus queued requests are at lanes + --max-pending-requests."""


SEED_MASK = (1 << 64) - 1  # torch generators take 64-bit seeds: larger ones are reduced to their low 64 bits


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    on_token: Callable[[int], None]
    on_done: Callable[[str, str | None], None]  # (finish_reason, error message)
    params: SamplingParams | None = None  # None = greedy
    stop_ids: frozenset = frozenset()
    seed: int | None = None
    images: list | None = None  # runtime.vision.ImageInput per placeholder run, in order
    checkpoint_at: int | None = None  # save GDN state here for the next turn (see Engine.prefill_chunks)
    on_admit: Callable[[], None] | None = None  # called (worker thread) once the request holds a lane
    # the prompt opens a thinking block: at most this many reasoning tokens, then the engine emits
    # `think_end` itself (the model's own end-of-thinking token) and the answer follows
    thinking_budget: int | None = None
    think_end: int | None = None
    thinks: bool = False  # the prompt opens a thinking block (ended by think_end)
    cached_tokens: int = 0  # prompt tokens the lane already held (set at admission)
    # tool_choice at decode time: tokens never sampled ("none": the call marker), tokens emitted first
    # once any thinking is over (a required / named call's opening), and a token after which the
    # generation ends (parallel_tool_calls false: the first call's close)
    banned_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # Chat's logit_bias: (token id, bias) added to every step's logits
    forced: tuple[int, ...] = ()
    stop_after: int | None = None  # counts once a call has opened (call_open) outside the thinking block
    call_open: int | None = None
    # logprobs: with a number (top alternatives, 0..20), each emitted token's (logprob, [(id, logprob)...])
    # is appended to logprob_sink before on_token sees the token
    logprobs: int | None = None
    logprob_sink: list = field(default_factory=list)
    grammar: object | None = None  # structured.AnswerGrammar: the answer's tokens masked by a JSON schema
    drafted: int = 0  # speculative draft tokens proposed for this request, and how many were accepted
    accepted: int = 0
    cancelled: bool = False
    enqueued_at: float = field(default_factory=time.monotonic)


@dataclass
class _Lane:
    request: GenerationRequest
    prefill: object  # the engine's prefill generator
    last_token: int | None = None
    generated: int = 0
    counts: torch.Tensor | None = None
    generator: torch.Generator | None = None
    thinking: bool = False  # inside the prompt's thinking block
    reasoning: int = 0  # reasoning tokens emitted so far
    forced: list[int] = field(default_factory=list)  # still to emit once thinking is over
    calls_opened: int = 0
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # the request's logit_bias as (ids, biases) on the device

    def budget_spent(self) -> bool:
        budget = self.request.thinking_budget
        return self.thinking and budget is not None and self.reasoning >= budget

    def chain_ready(self) -> bool:
        """The device may pick this lane's next tokens ahead of the host (chained decode): the host imposes
        nothing on them (grammar, bans, forced tokens, logprobs) and no thinking budget is spent (the host
        then emits </think> instead of the model's token, so the token handed out next must be the model's)."""
        return not self.host_imposed() and not self.budget_spent()

    def host_imposed(self) -> bool:
        """The host shapes this lane's tokens: forced tokens, bans, logit biases, logprobs or a grammar."""
        r = self.request
        return (bool(self.forced) or bool(r.banned_ids) or bool(r.logit_bias) or r.logprobs is not None
                or r.grammar is not None)

    def constrained(self) -> bool:
        """Decoding this lane needs the scheduler's token choice (no speculative rounds): a round could also
        run past a thinking budget that is not yet spent."""
        return (self.thinking and self.request.thinking_budget is not None) or self.host_imposed()


def _logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The token's log-probability under the model's distribution (before sampling filters) and the
    `top` most likely alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    alternatives = []
    if top:
        values, ids = torch.topk(lp, top)
        alternatives = list(zip(ids.tolist(), values.tolist()))
    return float(lp[token]), alternatives


@dataclass
class _Chained:
    """A decode step launched but not yet read back: its lanes (and the requests then holding them), the
    tokens it picked on the device (the next step's input) and their copy on its way to the host."""
    lanes: list[int]
    states: list[_Lane]
    picked: torch.Tensor  # [B] int64 on the device
    copy: HostCopy  # picked on its way to the host


# Chained decode (default on): while the same lanes keep decoding with tokens the device can pick itself
# (greedy or plain sampling: no grammar, bans, forced tokens or logprobs, no spent thinking budget; no speculation),
# each step is launched before the previous step's tokens reach the host, so detokenizing, parsing and
# streaming them runs while the GPU computes. A lane that ends has had one more token computed (its
# cache holds it: lane_tokens say so). NINFER_DECODE_CHAIN=off for side-by-side runs.
DECODE_CHAIN = setting("NINFER_DECODE_CHAIN") == "on"


class SchedulerDead(RuntimeError):
    """The worker loop stopped on an error it could not contain; the server must be restarted."""


class Scheduler:
    def __init__(self, engine, max_pending: int = 64, pending_timeout_ms: int = 0,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.max_pending = max_pending
        self.pending_timeout = pending_timeout_ms / 1000.0
        self.pending: collections.deque[GenerationRequest] = collections.deque()
        self.lanes: dict[int, _Lane] = {}
        self.cond = threading.Condition()
        self.stopping = False
        self.failure: BaseException | None = None  # set when the worker loop died: /health turns 503
        self.on_fatal = on_fatal
        self.stats = collections.Counter()
        self.riders = Riders()  # decode rows offered to each prefill chunk (Engine.prefill_chunks)
        self.chain = DECODE_CHAIN
        self.chained: _Chained | None = None  # the decode step in flight, when chaining
        self.thread = threading.Thread(target=self._supervised, name="ninfer-scheduler", daemon=True)
        self.thread.start()

    # --- client side ----------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request, or raise QueueFull at once: running + queued never exceed the lanes plus
        --max-pending-requests, whether or not the worker has admitted the earlier ones yet."""
        with self.cond:
            if self.failure is not None or self.stopping:
                raise SchedulerDead("the generation worker has stopped; the server is shutting down")
            if len(self.pending) + len(self.lanes) >= self.engine.lanes + self.max_pending:
                self.stats["rejected_queue_full"] += 1
                raise QueueFull(f"{len(self.lanes)} of {self.engine.lanes} lanes are busy and {len(self.pending)} "
                                f"requests are waiting (--max-pending-requests {self.max_pending})")
            self.pending.append(request)
            self.stats["submitted"] += 1
            self.cond.notify()

    def cancel(self, request: GenerationRequest) -> None:
        request.cancelled = True
        with self.cond:
            self.cond.notify()

    def expire(self, request: GenerationRequest) -> bool:
        """Take a request that is still waiting out of the queue (its wait ran out); False when it
        already holds a lane or is about to (a lane is free)."""
        with self.cond:
            if request in self.pending and len(self.lanes) >= self.engine.lanes:
                self.pending.remove(request)
                self.stats["timed_out"] += 1
                return True
            return False

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=10)

    @property
    def queue_depth(self) -> int:
        return len(self.pending)

    @property
    def active_lanes(self) -> int:
        return len(self.lanes)

    # --- worker ---------------------------------------------------------------------------

    def _supervised(self) -> None:
        """The worker loop; if anything escapes it, every waiting client gets an error (never a hang),
        `failure` is set (health 503) and on_fatal runs (the CLI exits non-zero for a supervisor)."""
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - the loop must never die silently
            traceback.print_exc(file=sys.stderr)
            with self.cond:
                self.failure = exc
                waiting = list(self.pending) + [state.request for state in self.lanes.values()]
                self.pending.clear()
                self.lanes.clear()
            if self.on_fatal is not None:
                self.on_fatal(exc)
            for req in waiting:
                req.on_done("error", f"generation worker stopped: {type(exc).__name__}")

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.stopping and not self.pending and not self.lanes:
                    self.cond.wait()
                if self.stopping:
                    return
                self._expire_and_admit()
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - one bad step must not take the server down
                traceback.print_exc(file=sys.stderr)
                self.chained = None
                for lane in list(self.lanes):
                    self._finish(lane, "error", f"engine failure: {type(exc).__name__}")

    def _expire_and_admit(self) -> None:
        now = time.monotonic()
        kept = collections.deque()
        for req in self.pending:
            if req.cancelled:
                req.on_done("cancelled", None)
            elif self.pending_timeout and now - req.enqueued_at > self.pending_timeout:
                self.stats["timed_out"] += 1
                req.on_done("timeout", f"waited more than {self.pending_timeout * 1000:.0f} ms for a free lane")
            else:
                kept.append(req)
        self.pending = kept
        free = [i for i in range(self.engine.lanes) if i not in self.lanes]
        while free and self.pending:
            req = self.pending.popleft()
            # a returning conversation goes back to the lane that still holds its prefix
            held = {i: self.engine.reusable_prefix(i, req.prompt) for i in free}
            lane = max(free, key=held.get)
            free.remove(lane)
            req.cached_tokens = 0 if req.images else held[lane]
            try:  # anything wrong with this request fails it alone
                chunks = self.engine.prefill_chunks(lane, req.prompt, reuse=not req.images, images=req.images,
                                                    checkpoint_at=req.checkpoint_at, riders=self.riders)
                state = _Lane(req, chunks, thinking=req.thinks and req.think_end is not None, forced=list(req.forced))
                if req.logit_bias:
                    ids, biases = zip(*req.logit_bias)
                    state.bias = (torch.tensor(ids, dtype=torch.long, device=self.engine.device),
                                  torch.tensor(biases, dtype=torch.float32, device=self.engine.device))
                if req.params is not None:
                    device = self.engine.device
                    state.counts = torch.zeros(1, self.engine.cfg.vocab_size, dtype=torch.int32, device=device)
                    state.generator = torch.Generator(device)
                    state.generator.manual_seed((req.seed if req.seed is not None else torch.seed()) & SEED_MASK)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                self.stats["finished_error"] += 1
                req.on_done("error", str(exc))
                continue
            self.lanes[lane] = state
            self.stats["admitted"] += 1
            if req.on_admit is not None:
                req.on_admit()

    def _pick(self, state: _Lane, logits: torch.Tensor, argmax: int | None = None) -> int:
        if argmax is not None and self._plain_greedy(state):
            return argmax
        banned = state.request.banned_ids
        if banned or state.bias is not None:
            logits = logits.to(torch.float32, copy=True)  # the engine's row stays as it is
        if state.bias is not None:
            logits.index_add_(0, *state.bias)
        if banned:
            logits[list(banned)] = float("-inf")
        grammar = state.request.grammar
        if grammar is not None and grammar.active and (not state.thinking or grammar.call is not None):
            logits = grammar.mask(logits)
        return pick_token(logits, state.request.params, state.counts, state.generator)

    @staticmethod
    def _plain_greedy(state: _Lane) -> bool:
        """The lane's token is its logits' argmax (no sampler, no mask): one batched argmax serves it."""
        r = state.request
        return r.params is None and not r.banned_ids and not r.logit_bias and r.grammar is None

    def _argmaxes(self, lanes: list[int], logits: torch.Tensor) -> list[int | None]:
        """Every row's argmax in one launch and one copy to the host (a sync per lane costs ~0.1 ms on a
        GPU), when any of these lanes is plain greedy."""
        if not any(lane in self.lanes and self._plain_greedy(self.lanes[lane]) for lane in lanes):
            return [None] * len(lanes)
        return logits.argmax(-1).tolist()

    def _emit(self, lane: int, token: int, forced: bool = False) -> None:
        state = self.lanes[lane]
        answering = not state.thinking
        if state.thinking:
            if token == state.request.think_end:
                state.thinking = False
            else:
                state.reasoning += 1
        state.generated += 1
        state.last_token = token
        self.stats["generated_tokens"] += 1
        if token in state.request.stop_ids:
            self._finish(lane, "stop", None)
            return
        grammar = state.request.grammar
        # forced tokens too (a call's opening); while thinking only a call: one opened before </think> (a drift
        # models show) is held to its tool's schema as well
        if grammar is not None and grammar.active and (answering or grammar.call is not None
                                                       or (token == grammar.escape and grammar.calls is not None)):
            error = grammar.advance(token)
            if error:
                self._finish(lane, "error", error)
                return
        state.request.on_token(token)
        if token == state.request.call_open:  # (set when calls end the reply) inside thinking too: the
            state.calls_opened += 1  # output parser ends the reasoning at a call marker, so does the count
            state.thinking = False
        if token == state.request.stop_after and state.calls_opened:
            self._finish(lane, "stop", None)
            return
        full = self.engine.held_tokens(lane) + 1 >= self.engine.opts.max_context
        if state.generated >= state.request.max_tokens or full:
            self._finish(lane, "length", None)

    def _finish(self, lane: int, reason: str, error: str | None) -> None:
        state = self.lanes.pop(lane, None)
        if state is not None:
            self.stats[f"finished_{reason}"] += 1
            try:
                state.request.on_done(reason, error)
            except Exception:  # noqa: BLE001 - a client's callback failing (its loop gone) ends only that client
                traceback.print_exc(file=sys.stderr)

    def _speculate(self, decoding: list[int]) -> list[int]:
        """One speculative round (MTP or DFlash2) for every lane that can draft (batched); returns the lanes left for a plain step."""
        eng = self.engine
        # a lane whose tokens the scheduler chooses decodes plainly (a round could run past a budget,
        # or sample a banned token in its drafts)
        spec = [lane for lane in decoding if eng.speculator.can_speculate(lane) and not self.lanes[lane].constrained()]
        if spec:
            states = [self.lanes[lane] for lane in spec]
            budgets = [max(1, min(s.request.max_tokens - s.generated, eng.opts.max_context - eng.held_tokens(lane) - 1))
                       for lane, s in zip(spec, states)]
            new = eng.speculator.round(spec, [s.last_token for s in states], budgets, [s.request.stop_ids for s in states],
                                [s.request.params for s in states], [s.counts for s in states],
                                [s.generator for s in states])
            for lane, tokens in zip(spec, new):
                request = self.lanes[lane].request
                request.drafted += eng.speculator.k
                request.accepted += max(0, len(tokens) - 1)  # the last token of a round is the target's own
                for tok in tokens:
                    if lane in self.lanes:
                        self._emit(lane, tok)
        return [lane for lane in decoding if lane not in spec]

    def _chainable(self, lanes: list[int]) -> bool:
        """These lanes' next step can be launched before the host sees their current tokens."""
        eng = self.engine
        limit = eng.opts.max_context - 2  # the chained step's token must fit, with one more after it
        return self.chain and eng.speculator is None and bool(lanes) and all(
            self.lanes[lane].chain_ready() and eng.held_tokens(lane) < limit for lane in lanes)

    def _pick_on_device(self, lanes: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Every lane's next token as the host path would pick it (argmax, or the lane's sampler with its
        generator and counts), left on the device."""
        picked = logits.argmax(-1)
        for row, lane in enumerate(lanes):
            state = self.lanes[lane]
            if state.request.params is not None:
                picked[row] = pick_token_on_device(logits[row], state.request.params, state.counts, state.generator)
        return picked

    def _chain_step(self, lanes: list[int]) -> None:
        """Launch the next decode step of these lanes (fed on the device by the step in flight, if any),
        then hand the in-flight step's tokens to their clients while the GPU runs the new one."""
        previous = self.chained
        if previous is None:
            logits = self.engine.decode_step(lanes, [self.lanes[lane].last_token for lane in lanes])
        else:
            logits = self.engine.decode_step(lanes, None, device_tokens=previous.picked)
        picked = self._pick_on_device(lanes, logits)
        self.chained = _Chained(lanes, [self.lanes[lane] for lane in lanes], picked, HostCopy.start(picked))
        if previous is not None:
            self.stats["chained_steps"] += 1
            tokens = previous.copy.tolist()
            self.engine.record_fed_tokens(lanes, tokens)
            self._hand_out(previous, tokens)

    def _hand_out(self, step: _Chained, tokens: list[int]) -> None:
        for lane, state, token in zip(step.lanes, step.states, tokens):
            if self.lanes.get(lane) is state:  # (a lane that ended, or now holds another request, drops it)
                self._pick_and_emit(lane, None, token)

    def _settle(self) -> None:
        """End the chain: the in-flight step's tokens go to their clients; no step is launched behind it."""
        step, self.chained = self.chained, None
        if step is not None:
            self._hand_out(step, step.copy.tolist())

    def _step(self) -> None:
        for lane, state in list(self.lanes.items()):
            if state.request.cancelled:
                self._finish(lane, "cancelled", None)
        if self.chained is not None:
            # the chain goes on only over the same requests, none prefilling, each still chainable
            same = all(self.lanes.get(lane) is state for lane, state in zip(self.chained.lanes, self.chained.states))
            if same and len(self.lanes) == len(self.chained.lanes) and self._chainable(self.chained.lanes):
                self._chain_step(self.chained.lanes)
                return
            self._settle()
        rode: set[int] = set()
        for lane, state in list(self.lanes.items()):
            if lane not in self.lanes or state.last_token is not None:
                continue
            # still prefilling: one chunk, which the decoding lanes' next rows ride when the engine can
            # take them (else the chunk is only shortened and they decode after it)
            decoders = [other for other, s in self.lanes.items() if s.last_token is not None]
            self.riders.offer(decoders, [self.lanes[other].last_token for other in decoders])
            try:
                logits = next(state.prefill)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                self._finish(lane, "error", str(exc))
                for other in self.riders.advanced:  # counted into a forward that failed: their state is gone
                    self._finish(other, "error", "engine failure in a shared prefill step")
                continue
            if self.riders.logits is not None:
                argmaxes = self._argmaxes(self.riders.advanced, self.riders.logits)
                for row, other in enumerate(self.riders.advanced):
                    if other in self.lanes:
                        self._pick_and_emit(other, self.riders.logits[row], argmaxes[row])
                        rode.add(other)
            if logits is not None:
                self._pick_and_emit(lane, logits)
        decoding = [lane for lane, s in self.lanes.items() if s.last_token is not None and lane not in rode]
        if not decoding:
            return
        if self.engine.speculator is not None:
            decoding = self._speculate(decoding)
            if not decoding:
                return
        if not rode and len(decoding) == len(self.lanes) and self._chainable(decoding):
            self._chain_step(decoding)
            return
        logits = self.engine.decode_step(decoding, [self.lanes[lane].last_token for lane in decoding])
        argmaxes = self._argmaxes(decoding, logits)
        for row, lane in enumerate(decoding):
            self._pick_and_emit(lane, logits[row], argmaxes[row])

    def _pick_and_emit(self, lane: int, logits: torch.Tensor | None, argmax: int | None = None) -> None:
        """Sample this lane's next token and hand it to its client; a failure here (its sampling
        values, its callback) ends this lane's request alone. logits None: `argmax` is the token the
        device already picked (a chained step)."""
        try:
            state = self.lanes[lane]
            forced = bool(state.forced) and not state.thinking  # (a spent budget implies thinking)
            if state.budget_spent():  # the end-of-thinking token instead of a sample
                token = state.request.think_end
            elif forced:  # a required call's opening (a grammar, if any, starts after it)
                token = state.forced.pop(0)
            elif logits is None:
                token = argmax
            else:
                token = self._pick(state, logits, argmax)
            if state.request.logprobs is not None:
                state.request.logprob_sink.append(_logprobs(logits, token, state.request.logprobs))
            self._emit(lane, token, forced)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            self._finish(lane, "error", f"generation failed: {type(exc).__name__}")
