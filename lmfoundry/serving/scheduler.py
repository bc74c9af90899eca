"""Continuous batching: one thread runs the model for every request in flight.

Each running request owns a slot of one KV cache. At every iteration the thread admits waiting
requests into free slots (their prompts in one right-padded prefill pass, up to a prompt-token
budget so that long prompts do not stall the running ones for long), then runs one decode pass
over all running requests together: one new token each. A request that finishes or is cancelled frees its slot at that
token boundary and the next waiting request takes it, so requests join and leave the running
batch without waiting for each other (the scheduling of Orca and vLLM, without paged memory).
With a prefix cache (prefix_cache.py), a prompt whose leading blocks were prefilled before, in
the same scope, starts from a copy of their keys and values and only its rest is prefilled.

Token ids in, token ids out; text, stop strings and HTTP live in engine.py and api.py.
"""

from __future__ import annotations

import collections
import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lmfoundry.model.generate import sample_next
from lmfoundry.model.transformer import KVCache, Transformer
from lmfoundry.platform.log import get_logger
from lmfoundry.serving.decode_attention import engine_attention
from lmfoundry.serving.prefix_cache import PrefixCache, block_keys, scope_root
from lmfoundry.serving.sampling import SamplingParams, TokenLogprob, adjust_logits, token_logprobs

logger = get_logger(__name__)

# What a request's callback receives, in order: token ids, then one finish reason ("stop" for a
# stop token, which is not passed on, "length" at max_tokens, "cancelled"), or an exception
# if the model failed. Log-probabilities, when asked for, are on the Request (`logprobs`,
# `prompt_logprobs`), written before the token they belong to is emitted.
Item = int | str | BaseException


class Overloaded(RuntimeError):
    """The waiting queue is full: the caller should answer 503 and let the client retry."""


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Item], None]  # called on the scheduler thread; must not block
    generator: torch.Generator | None = None
    produced: int = 0
    last_token: int = -1
    slot: int = -1
    cancelled: bool = False
    # constrained decoding (grammar.JsonSchemaConstraint): allowed() token ids, advance(token), done()
    constraint: object | None = None
    counts: torch.Tensor | None = None  # (V,) tokens generated so far, kept only under penalties
    # one entry per generated token, and one for a stop token that ended the request
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1..n-1
    # prefix reuse: the chained keys of the prompt's full blocks and their scope's root (empty: none)
    block_keys: list[bytes] = field(default_factory=list)
    scope_key: bytes = b""
    cached: list[int] = field(default_factory=list)  # prefix-cache blocks matched when admitted
    submitted_at: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None  # the engine's time for it is finished_at - submitted_at

    def cancel(self) -> None:
        """Ends the request at the next token boundary (a client that went away)."""
        self.cancelled = True


class ContinuousBatcher:
    """`load()` builds the model; it runs on the batcher's own thread, which is then the only
    thread that runs the model. (On CPU, a second thread that runs OpenMP-parallel torch ops
    slows every thread's ops down: measured 2x on a matmul, 10x on attention, for good.)"""

    def __init__(
        self,
        load: Callable[[], Transformer],
        stop_ids: frozenset[int],
        max_batch_size: int = 16,
        max_waiting: int = 256,
        max_prefill_tokens: int = 2048,
        prefix_cache_tokens: int = 0,
        prefix_block_tokens: int = 16,
    ):
        """prefix_cache_tokens: prompt tokens whose keys and values are kept for reuse (0: none),
        in blocks of prefix_block_tokens."""
        self.stop_ids = stop_ids
        self.prefix_cache_tokens = prefix_cache_tokens
        self.prefix_block_tokens = prefix_block_tokens
        self.prefix_cache: PrefixCache | None = None
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}  # slot -> request
        self._free = list(range(max_batch_size))  # a heap: the lowest free slot is taken first
        self._wake = threading.Condition()
        self._closed = False
        self.stats = collections.Counter()  # decode_steps, decode_rows, prefills, prefill_passes, prefill_tokens
        self._loaded = threading.Event()
        # OpenMP's thread count is a per-thread setting: a new thread starts from the default
        # (every core), not from what torch.set_num_threads chose on the caller's thread
        self._threads = torch.get_num_threads()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(load,), name="continuous-batcher", daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            raise self._load_error

    def _run(self, load: Callable[[], Transformer]) -> None:
        try:
            torch.set_num_threads(self._threads)
            self.model = load()
            param = next(self.model.parameters())
            self.device = param.device
            self.context = self.model.cfg.max_seq_len
            cfg = self.model.cfg
            attention = engine_attention(cfg.n_head, cfg.n_kv_head, cfg.head_dim, param.dtype, self.device)
            self.cache = KVCache(cfg, self.max_batch_size, self.context, self.device, param.dtype, attention)
            if self.prefix_cache_tokens:
                self.prefix_cache = PrefixCache(
                    self.model.cfg, self.prefix_cache_tokens, self.prefix_block_tokens, self.device, param.dtype
                )
        except BaseException as exc:  # handed to the constructor, which raises it
            self._load_error = exc
            return
        finally:
            self._loaded.set()
        self._loop()

    # ---- the caller's side (any thread) ----

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        emit: Callable[[Item], None],
        constraint=None,
        cache_scope: str | None = None,
    ) -> Request:
        """cache_scope: the scope in which the prompt's prefix may be reused (a tenant's name, or
        "" for all); None: no reuse. A request that scores its prompt never reuses one (it
        needs the output layer at every prompt position)."""
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if len(prompt) + params.max_tokens > self.context:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens plus max_tokens={params.max_tokens} exceeds "
                f"the model's context of {self.context}"
            )
        if params.max_tokens == 0 and params.prompt_logprobs is None:
            raise ValueError("max_tokens=0 generates nothing; it is for scoring the prompt (prompt logprobs)")
        gen = torch.Generator(device=self.device).manual_seed(params.seed) if params.seed is not None else None
        req = Request(prompt, params, emit, gen, constraint=constraint)
        if self.prefix_cache is not None and cache_scope is not None and params.prompt_logprobs is None:
            # hashed here, on the caller's thread, not on the thread that runs the model
            req.block_keys = block_keys(prompt, self.prefix_block_tokens, cache_scope)
            req.scope_key = scope_root(cache_scope)
        if params.penalised:
            req.counts = torch.zeros(self.model.cfg.vocab_size, device=self.device)
        with self._wake:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            if len(self._waiting) >= self.max_waiting:
                raise Overloaded(f"{len(self._waiting)} requests are already waiting (max_waiting={self.max_waiting})")
            self._waiting.append(req)
            self._wake.notify()
        return req

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # ---- the scheduler thread ----

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._running:
                    self._wake.wait()
                if self._closed:
                    break
                admitted = self._take_waiting()
            try:
                with torch.inference_mode():
                    if admitted:
                        self._prefill(admitted)
                    if self._running:
                        self._decode()
            except Exception as exc:  # a model failure ends the requests in flight, not the server
                logger.exception("generation failed; ending %d requests", len(self._running))
                for req in list(self._running.values()):
                    self._finish(req, exc)
        for req in list(self._running.values()) + list(self._waiting):
            req.emit("cancelled")

    def _take_waiting(self) -> list[Request]:
        admitted, budget = [], self.max_prefill_tokens
        while self._waiting and self._free:
            req = self._waiting[0]
            if req.cancelled:
                self._waiting.popleft()
                req.emit("cancelled")
                continue
            if req.block_keys:
                req.cached = self.prefix_cache.match(req.block_keys, req.prompt, req.scope_key)
            to_compute = len(req.prompt) - len(req.cached) * self.prefix_block_tokens
            # always admit one when nothing runs, however long its prompt
            if admitted and to_compute > budget:
                break
            self._waiting.popleft()
            req.slot = heapq.heappop(self._free)
            self._running[req.slot] = req
            admitted.append(req)
            budget -= to_compute
        return admitted

    def _prefill(self, reqs: list[Request]) -> None:
        """The prompts of the requests just admitted: those that only generate in passes of
        similar lengths, and each that scores its prompt in a pass of its own (the output layer
        at every position of its prompt, memory its length x the vocabulary, is paid by that
        request alone). Reused prefixes are copied into their slots before any pass runs (a
        pass's new blocks may evict them from the pool), and the new blocks kept after all."""
        self.cache.reset(torch.tensor([r.slot for r in reqs], device=self.device))
        starts = {}
        for req in reqs:
            starts[req.slot] = self.prefix_cache.load(self.cache, req.slot, req.cached) if req.cached else 0
            self.cache.lengths[req.slot] = starts[req.slot]
            self.stats["prefix_reused_tokens"] += starts[req.slot]
        plain = [r for r in reqs if r.params.prompt_logprobs is None]
        for group in self._prefill_groups(plain, starts):
            self._prefill_pass(group, starts)
        for req in reqs:
            if req.params.prompt_logprobs is not None:
                self._prefill_pass([req], starts, scoring=True)
        for req in reqs:
            if req.block_keys:  # a request that already ended still left its prompt in its slot
                self.prefix_cache.store(self.cache, req.slot, req.block_keys, req.prompt, req.scope_key)

    def _prefill_groups(self, reqs: list[Request], starts: dict[int, int]) -> list[list[Request]]:
        """Passes of rows of similar lengths to compute, shortest first: a row joins a pass while
        the padding stays under the tokens computed, and every row's padded end inside the
        context. (A prompt that reuses a 1,000-token prefix computes a few tokens; padded to an
        uncached prompt's length, it would compute them all again.)"""
        groups: list[list[Request]] = []
        computed = 0
        for req in sorted(reqs, key=lambda r: len(r.prompt) - starts[r.slot]):
            n = len(req.prompt) - starts[req.slot]
            group = groups[-1] if groups else None
            if (
                group is None
                or (len(group) + 1) * n > 2 * (computed + n)
                or max(starts[r.slot] for r in (*group, req)) + n > self.context
            ):
                groups.append([req])
                computed = n
            else:
                group.append(req)
                computed += n
        return groups

    def _prefill_pass(self, reqs: list[Request], starts: dict[int, int], scoring: bool = False) -> None:
        """One pass over the prompts' uncomputed parts, right-padded to the longest; each row
        continues its slot from where its reused prefix ends. A padded row writes keys and
        values past its prompt; its length is set back to the prompt's, so they are masked and
        then overwritten as its sequence grows. The output layer runs at each prompt's last
        position only (`logits_at`) unless the pass scores its prompt."""
        parts = [r.prompt[starts[r.slot] :] for r in reqs]
        widths = torch.tensor([len(p) for p in parts], device=self.device)
        ids = torch.zeros(len(reqs), int(widths.max()), dtype=torch.long, device=self.device)
        for row, part in enumerate(parts):
            ids[row, : len(part)] = torch.tensor(part, device=self.device)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        logits, _ = self.model(ids, cache=self.cache, slots=slots, logits_at=None if scoring else widths - 1)
        self.cache.lengths[slots] = torch.tensor([len(r.prompt) for r in reqs], device=self.device)
        self.stats["prefills"] += len(reqs)
        self.stats["prefill_passes"] += 1
        self.stats["prefill_tokens"] += int(widths.sum())
        if scoring:
            (req,) = reqs
            if len(req.prompt) > 1:
                scores = torch.log_softmax(logits[0, :-1].float(), -1)
                req.prompt_logprobs = token_logprobs(scores, ids[0, 1:], req.params.prompt_logprobs)
            last = logits[:, -1]
        else:
            last = logits[:, 0]
        self._sample(reqs, last)

    def _decode(self) -> None:
        # in slot order: when the running slots are consecutive the cache is read without a copy
        reqs = sorted(self._running.values(), key=lambda r: r.slot)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        tokens = torch.tensor([[r.last_token] for r in reqs], device=self.device)
        logits, _ = self.model(tokens, cache=self.cache, slots=slots)
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(reqs)
        self._sample(reqs, logits[:, -1])

    def _sample(self, reqs: list[Request], raw: torch.Tensor) -> None:
        """The next token of every row of `raw` (B, V): bias and penalties for the whole batch at
        once, the greedy choices in one argmax, log-probabilities of the rows that ask for them
        in one log-softmax; then each request samples (under its own generator and grammar)."""
        logits = adjust_logits(raw, [r.params for r in reqs], [r.counts for r in reqs])
        greedy = logits.argmax(-1).tolist()
        scored = [b for b, r in enumerate(reqs) if r.params.logprobs is not None]
        logprobs = dict(zip(scored, torch.log_softmax(raw[scored].float(), -1))) if scored else {}
        for row, req in enumerate(reqs):
            token = greedy[row] if req.params.temperature <= 0 else None
            self._advance_one(req, logits[row], token, logprobs.get(row))

    def _advance_one(
        self, req: Request, logits: torch.Tensor, token: int | None = None, logprobs: torch.Tensor | None = None
    ) -> None:
        """A failure that belongs to one request (its sampling, its grammar) ends that one only."""
        try:
            self._advance(req, logits, token, logprobs)
        except Exception as exc:
            logger.exception("request in slot %d failed", req.slot)
            if req.slot in self._running:
                self._finish(req, exc)

    def _advance(
        self, req: Request, logits: torch.Tensor, token: int | None = None, logprobs: torch.Tensor | None = None
    ) -> None:
        """Sample the request's next token from its logits and pass it on, or finish it."""
        if req.cancelled:
            self._finish(req, "cancelled")
            return
        if req.params.max_tokens == 0:  # the prompt was scored; nothing is generated
            self._finish(req, "length")
            return
        if req.constraint is not None:
            allowed = torch.tensor(req.constraint.allowed(), device=logits.device)
            masked = torch.full_like(logits, float("-inf"))
            masked[allowed] = logits[allowed]
            logits, token = masked, None
        if token is None:
            token = sample_next(logits, req.params.temperature, req.params.top_p, req.generator)
        if logprobs is not None:
            req.logprobs += token_logprobs(
                logprobs[None], torch.tensor([token], device=logprobs.device), req.params.logprobs
            )
        if token in self.stop_ids:
            self._finish(req, "stop")
            return
        if req.constraint is not None:
            req.constraint.advance(token)
        if req.counts is not None:
            req.counts[token] += 1
        req.produced += 1
        req.last_token = token
        req.emit(token)
        if req.constraint is not None and req.constraint.done():
            self._finish(req, "stop")
        elif req.produced >= req.params.max_tokens:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str | BaseException) -> None:
        del self._running[req.slot]
        heapq.heappush(self._free, req.slot)
        req.finished_at = time.perf_counter()
        req.emit(reason)
