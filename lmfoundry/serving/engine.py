"""The default inference engine: a checkpoint run with PyTorch under continuous batching
(scheduler.py), text in and out, the checkpoint's chat template (model/chat_template.py).

Every request is a token stream from the shared batcher; this module turns it into text deltas,
holding back text that could still become a stop string or is half a UTF-8 character.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lmfoundry.model.chat_template import ChatTemplate
from lmfoundry.model.checkpoint import MODEL_CONFIG, TOKENIZER, load_model_files
from lmfoundry.model.tokenizer import SpecialTokens
from lmfoundry.model.transformer import Transformer
from lmfoundry.platform import checkpoint
from lmfoundry.serving.packed_linear import pack_linears
from lmfoundry.serving.sampling import SamplingParams, TokenLogprob
from lmfoundry.serving.scheduler import ContinuousBatcher


@dataclass
class Delta:
    text: str
    finish_reason: str | None  # set on the last delta only
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens since the last delta


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # when asked for: one per token, a stop token's too
    prompt_logprobs: list[TokenLogprob] | None = None  # when asked for: prompt tokens 1..n-1


class GenerationFailed(RuntimeError):
    pass


# the precisions the engine runs in (EngineConfig.dtype names the same)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_for_serving(directory: str | Path, device: str, dtype: str) -> Transformer:
    """The checkpoint's model as the engine runs it: in `dtype`, its linear layers packed for
    oneDNN on the CPU (packed_linear.py)."""
    model = load_model_files(directory, device).to(DTYPES[dtype])
    pack_linears(model)
    return model


class InferenceEngine:
    def __init__(
        self,
        checkpoint_uri: str,
        device: str = "auto",
        max_batch_size: int = 16,
        max_waiting: int = 256,
        max_prefill_tokens: int = 2048,
        dtype: str = "float32",
        prefix_cache: dict | None = None,
    ):
        """prefix_cache: PrefixCacheConfig's keys (app.py); None or not enabled: no reuse."""
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype not in DTYPES:
            raise ValueError(f"engine dtype {dtype!r} is not one of {', '.join(map(repr, DTYPES))}")
        # everything is read inside the block (the batcher loads the model before it returns):
        # a temporary copy of a remote checkpoint goes when it ends
        with checkpoint.opened(checkpoint_uri, model_only=True) as (local, self.manifest):
            if json.loads(Path(local, MODEL_CONFIG).read_text()).get("reward_head"):
                raise ValueError(f"{checkpoint_uri} is a reward model: it scores text and cannot generate")
            self.tokenizer = Tokenizer.from_file(f"{local}/{TOKENIZER}")
            self.chat_template = ChatTemplate.from_checkpoint(local)
            # lmfoundry's <|endoftext|> and <|im_end|>, or an imported model's eos and end of turn
            self.special = SpecialTokens.of_checkpoint(local)
            self.stop_ids = self.special.stop_ids(self.tokenizer)
            self.batcher = ContinuousBatcher(
                lambda: load_for_serving(local, device, dtype),
                self.stop_ids,
                max_batch_size,
                max_waiting,
                max_prefill_tokens,
                prefix_cache["max_tokens"] if prefix_cache and prefix_cache["enabled"] else 0,
                prefix_cache["block_tokens"] if prefix_cache else 16,
            )
        self.context = self.batcher.context

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids below this are both in the tokenizer and in the model's output layer."""
        return min(self.tokenizer.get_vocab_size(with_added_tokens=True), self.batcher.model.cfg.vocab_size)

    def token_text(self, token: int) -> str:
        """A token's own text; a special token (which decoding drops) by its name."""
        return self.tokenizer.decode([token]) or (self.tokenizer.id_to_token(token) or "")

    def check_ids(self, ids: list[int]) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})")

    def prepare(self, prompt: str | list[int], max_tokens: int | None) -> tuple[list[int], int]:
        """The prompt's token ids (a string is tokenized, ids are checked against the
        vocabulary) and the number of tokens to generate; a ValueError naming the limit when they
        do not fit the context (raised before anything is queued or streamed). max_tokens=0
        (scoring the prompt) may fill the whole context."""
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            self.check_ids(prompt)
            ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty after tokenization")
        room = self.context - len(ids)
        if room < (0 if max_tokens == 0 else 1):
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {self.context}")
        if max_tokens is not None and max_tokens > room:
            raise ValueError(
                f"max_tokens={max_tokens} does not fit: the prompt has {len(ids)} tokens "
                f"and the context is {self.context}, so at most {room}"
            )
        return ids, max_tokens if max_tokens is not None else room

    @functools.cached_property
    def grammars(self):
        from lmfoundry.serving.grammar import Grammars

        return Grammars(self.tokenizer, self.special.eos_id(self.tokenizer))

    def stream(
        self, ids: list[int], params: SamplingParams, schema: dict | None = None, cache_scope: str | None = None
    ) -> TextStream:
        """Queue a generation now (raises Overloaded at once when the queue is full) and return
        its text stream; with `schema`, the text is JSON that the schema accepts. `cache_scope`:
        where the prompt's prefix may be reused (scheduler.submit). Must be called on the event
        loop that will read the stream."""
        constraint = self.grammars.constraint(schema) if schema is not None else None
        return TextStream(self, ids, params, constraint, cache_scope)


class TextStream:
    """Deltas of new text as tokens arrive; the last one carries the finish reason. Text that
    could still become a stop string, or is half a UTF-8 character, is held back until it is
    clear. `cancel()` (a client that went away) frees the batch slot at the next token."""

    def __init__(
        self,
        engine: InferenceEngine,
        ids: list[int],
        params: SamplingParams,
        constraint=None,
        cache_scope: str | None = None,
    ):
        self.tokenizer = engine.tokenizer
        self.prompt_tokens = len(ids)
        self.stop = params.stop
        self.params = params
        self.reported = 0  # log-probabilities already handed out in deltas
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = 0  # characters of the decoded text already given out
        self.finished = False
        self.first_token_at: float | None = None  # when the batcher produced it
        self.ended_at: float | None = None  # when the batcher produced the finish (or failed)
        self.last_item_at: float | None = None  # when the batcher produced its latest item
        self.generated = 0  # tokens the batcher produced, read or not (what a client that left used)
        loop = asyncio.get_running_loop()
        # Items cross from the batcher's thread in a deque; the event loop is woken once per
        # batch of items, not once per token (a wake-up per token cost a replica 1-2 ms of each
        # token on a busy 2-core machine: benchmarks/serve_overhead.py). `collect()` without stop
        # strings needs no token before the last, so then only the end wakes it.
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._woken = False  # a wake-up is on its way, or the reader is not waiting
        self._lazy = False

        def emit(item) -> None:  # on the batcher's thread
            self.last_item_at = now = time.perf_counter()
            self.generated += isinstance(item, int)
            if self.first_token_at is None and isinstance(item, int):
                self.first_token_at = now
            elif not isinstance(item, int):
                self.ended_at = now
            self._items.append(item)
            if self._woken or (self._lazy and isinstance(item, int)):
                return
            self._woken = True
            try:
                loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the event loop is gone: nobody is listening any more
                self.request.cancel()

        self.request = engine.batcher.submit(ids, params, emit, constraint, cache_scope)

    def cancel(self) -> None:
        self.request.cancel()

    def _delta(self, text: str, finish: str | None, every_logprob: bool = False) -> Delta:
        """`every_logprob`: the batcher has ended the request, so every log-probability it wrote
        belongs to this delta (a stop token's too); otherwise those of the tokens read so far."""
        if finish is not None:
            self.finished = True
            self.cancel()  # a stop string ends the request before the model does
        upto = None if every_logprob else len(self.tokens)
        logprobs = self.request.logprobs[self.reported : upto]
        self.reported += len(logprobs)
        return Delta(text, finish, self.prompt_tokens, len(self.tokens), logprobs)

    async def next_delta(self) -> Delta:
        if self.finished:
            raise StopAsyncIteration
        while True:
            item = await self._next_item()
            if isinstance(item, BaseException):
                self.finished = True
                raise GenerationFailed(f"generation failed: {type(item).__name__}: {item}") from item
            if isinstance(item, str):
                return self._delta(self.tokenizer.decode(self.tokens)[self.sent :], item, every_logprob=True)
            self.tokens.append(item)
            text = self.tokenizer.decode(self.tokens)
            hit = min((text.index(s) for s in self.stop if s in text), default=-1)
            if hit >= 0:
                return self._delta(text[self.sent : hit], "stop")
            ready = len(text) - self.hold
            while ready > self.sent and text[ready - 1] == "\ufffd":
                ready -= 1
            if ready > self.sent:
                start, self.sent = self.sent, ready
                return self._delta(text[start:ready], None)

    async def _next_item(self):
        while not self._items:
            self._ready.clear()
            self._woken = False
            if self._items:  # arrived while a stale wake-up was thought to be on its way
                break
            await self._ready.wait()
        return self._items.popleft()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        return await self.next_delta()

    async def collect(self) -> Completion:
        self._lazy = not self.stop
        parts = [d async for d in self]
        last = parts[-1]
        return Completion(
            "".join(p.text for p in parts),
            last.prompt_tokens,
            last.completion_tokens,
            last.finish_reason,
            [lp for p in parts for lp in p.logprobs] if self.params.logprobs is not None else None,
            self.request.prompt_logprobs if self.params.prompt_logprobs is not None else None,
        )
