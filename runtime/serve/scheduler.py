"""Lane scheduler: a FIFO admission queue in front of the engine's 1..8 lanes.

One worker thread owns the engine. Each turn of its loop it admits waiting requests into free
lanes (first come, first served), runs one prefill chunk for every lane still prefilling, then one
batched decode step over every decoding lane — so a long prompt never stalls the other lanes for
more than a chunk. Requests talk to the worker only through callbacks and flags.
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

from ..kernels.sampling import SamplingParams, pick_token


class QueueFull(RuntimeError):
    """Every lane is busy and the pending queue is at --max-pending-requests."""


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


class Scheduler:
    def __init__(self, engine, max_pending: int = 64, pending_timeout_ms: int = 0):
        self.engine = engine
        self.max_pending = max_pending
        self.pending_timeout = pending_timeout_ms / 1000.0
        self.pending: collections.deque[GenerationRequest] = collections.deque()
        self.lanes: dict[int, _Lane] = {}
        self.cond = threading.Condition()
        self.stopping = False
        self.stats = collections.Counter()
        self.thread = threading.Thread(target=self._run, name="ninfer-scheduler", daemon=True)
        self.thread.start()

    # --- client side ----------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> None:
        with self.cond:
            if len(self.pending) >= self.max_pending and len(self.lanes) >= self.engine.lanes:
                self.stats["rejected_queue_full"] += 1
                raise QueueFull(f"all {self.engine.lanes} lanes are busy and {len(self.pending)} requests are waiting")
            self.pending.append(request)
            self.stats["submitted"] += 1
            self.cond.notify()

    def cancel(self, request: GenerationRequest) -> None:
        request.cancelled = True
        with self.cond:
            self.cond.notify()

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
                for lane in list(self.lanes):
                    self._finish(lane, "error", f"engine failure: {exc}")

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
            lane = max(free, key=lambda i: self.engine.reusable_prefix(i, req.prompt))
            free.remove(lane)
            try:
                chunks = self.engine.prefill_chunks(lane, req.prompt, reuse=not req.images, images=req.images,
                                                    checkpoint_at=req.checkpoint_at)
            except Exception as exc:  # noqa: BLE001
                req.on_done("error", str(exc))
                continue
            state = _Lane(req, chunks)
            if req.params is not None:
                device = self.engine.device
                state.counts = torch.zeros(1, self.engine.cfg.vocab_size, dtype=torch.int32, device=device)
                state.generator = torch.Generator(device)
                state.generator.manual_seed(req.seed if req.seed is not None else torch.seed())
            self.lanes[lane] = state
            self.stats["admitted"] += 1

    def _pick(self, state: _Lane, logits: torch.Tensor) -> int:
        return pick_token(logits, state.request.params, state.counts, state.generator)

    def _emit(self, lane: int, token: int) -> None:
        state = self.lanes[lane]
        state.generated += 1
        state.last_token = token
        self.stats["generated_tokens"] += 1
        if token in state.request.stop_ids:
            self._finish(lane, "stop", None)
            return
        state.request.on_token(token)
        full = self.engine.held_tokens(lane) + 1 >= self.engine.opts.max_context
        if state.generated >= state.request.max_tokens or full:
            self._finish(lane, "length", None)

    def _finish(self, lane: int, reason: str, error: str | None) -> None:
        state = self.lanes.pop(lane, None)
        if state is not None:
            self.stats[f"finished_{reason}"] += 1
            state.request.on_done(reason, error)

    def _speculate(self, decoding: list[int]) -> list[int]:
        """One speculative round (MTP or DFlash2) for every lane that can draft (batched); returns the lanes left for a plain step."""
        eng = self.engine
        spec = [lane for lane in decoding if eng.speculator.can_speculate(lane)]
        if spec:
            states = [self.lanes[lane] for lane in spec]
            budgets = [max(1, min(s.request.max_tokens - s.generated, eng.opts.max_context - eng.held_tokens(lane) - 1))
                       for lane, s in zip(spec, states)]
            new = eng.speculator.round(spec, [s.last_token for s in states], budgets, [s.request.stop_ids for s in states],
                                [s.request.params for s in states], [s.counts for s in states],
                                [s.generator for s in states])
            for lane, tokens in zip(spec, new):
                for tok in tokens:
                    if lane in self.lanes:
                        self._emit(lane, tok)
        return [lane for lane in decoding if lane not in spec]

    def _step(self) -> None:
        for lane, state in list(self.lanes.items()):
            if state.request.cancelled:
                self._finish(lane, "cancelled", None)
        for lane, state in list(self.lanes.items()):
            if state.last_token is None:  # still prefilling: one chunk
                try:
                    logits = next(state.prefill)
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc(file=sys.stderr)
                    self._finish(lane, "error", str(exc))
                    continue
                if logits is not None:
                    self._emit(lane, self._pick(state, logits))
        decoding = [lane for lane, s in self.lanes.items() if s.last_token is not None]
        if not decoding:
            return
        if self.engine.speculator is not None:
            decoding = self._speculate(decoding)
            if not decoding:
                return
        logits = self.engine.decode_step(decoding, [self.lanes[lane].last_token for lane in decoding])
        for row, lane in enumerate(decoding):
            self._emit(lane, self._pick(self.lanes[lane], logits[row]))
