"""The language-model protocol every suite and judge asks, and a checkpoint that answers it in process.

Every suite asks a model one of three things: how likely a continuation is after a context
(`loglikelihood`: multiple choice, calibration), what it writes after a raw prompt (`complete`:
generation tasks of a base model), and what it replies to a conversation (`chat`: instructions,
refusals, needles, attacks). `CheckpointModel` answers all three from a checkpoint on this
machine; `clients/openai.py: EndpointModel` answers the last two over any OpenAI-compatible
endpoint, so the same suites test the model lmfoundry serves, or anyone else's.

Log-likelihoods follow lm-evaluation-harness exactly (the context's trailing spaces move to the
continuation, the pair is tokenized whole and split after the context's tokens, inputs are cut
from the left to the context window), so that scores agree with the harness run on the Hugging
Face export.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


class EvalModel(Protocol):
    name: str

    def loglikelihood(self, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of the continuation's tokens, whether greedy decoding
        would have produced exactly the continuation), per (context, continuation)."""

    def complete(self, prompts: list[str], max_tokens: int, stop: list[str] = ()) -> list[str]:
        """Greedy continuation of each raw prompt, cut at the first stop string."""

    def chat(self, conversations: list[list[dict]], max_tokens: int) -> list[str]:
        """Greedy reply to each conversation of OpenAI-style messages."""

    def count_tokens(self, text: str) -> int:
        """The length of a text in the model's tokens (the unit of context lengths)."""


class Blocked(str):
    """A reply the endpoint's own guardrails withheld (a 400 content_policy_violation, or a reply
    cut with finish_reason content_filter): a refusal by the system, whatever its text."""


def cut_at_stop(text: str, stop: list[str]) -> str:
    cuts = [text.index(s) for s in stop if s and s in text]
    return text[: min(cuts)] if cuts else text


class CheckpointModel:
    """A checkpoint run with PyTorch in this process (CPU or GPU)."""

    def __init__(self, checkpoint_dir: str, batch_size: int = 16, device: str | None = None):
        from tokenizers import Tokenizer

        from lmfoundry.model.chat_template import ChatTemplate
        from lmfoundry.model.checkpoint import TOKENIZER, load_model_files
        from lmfoundry.model.tokenizer import SpecialTokens

        self.name = checkpoint_dir
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_model_files(checkpoint_dir, self.device)
        self.tokenizer = Tokenizer.from_file(f"{checkpoint_dir}/{TOKENIZER}")
        self.template = ChatTemplate.from_checkpoint(checkpoint_dir)
        special = SpecialTokens.of_checkpoint(checkpoint_dir)
        self.eos = special.eos_id(self.tokenizer)
        self.stop_tokens = special.stop_ids(self.tokenizer)
        self.batch_size = batch_size
        self.max_length = self.model.cfg.max_seq_len

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:  # as the harness does: the end-of-text token stands for an empty context
            return [self.eos], self.encode(continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self.encode(context + continuation), self.encode(context)
        return head, whole[len(head) :]

    @torch.no_grad()
    def loglikelihood(self, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        encoded = [self._encode_pair(c, x) for c, x in requests]
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]) - len(encoded[i][1]))
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            inputs, spans = [], []
            for i in rows:
                context, continuation = encoded[i]
                if not continuation:
                    raise ValueError(f"request {i}: the continuation {requests[i][1]!r} has no tokens to score")
                sequence = (context + continuation)[-(self.max_length + 1) :][:-1]
                inputs.append(sequence)
                spans.append((len(sequence) - len(continuation), continuation))
            logprobs = self._logprobs(inputs)
            for r, (i, (begin, continuation)) in enumerate(zip(rows, spans)):
                scored = logprobs[r, begin : begin + len(continuation)]
                target = torch.tensor(continuation)
                total = float(scored.gather(1, target[:, None]).sum())
                results[i] = (total, bool((scored.argmax(dim=-1) == target).all()))
        return results

    @torch.no_grad()
    def sequence_nll(self, sequences: list[list[int]]) -> float:
        """Summed negative log-likelihood of every token but the first of each sequence."""
        total = 0.0
        for start in range(0, len(sequences), self.batch_size):
            rows = sequences[start : start + self.batch_size]
            logprobs = self._logprobs([ids[:-1] for ids in rows])
            for r, ids in enumerate(rows):
                targets = torch.tensor(ids[1:])
                total -= float(logprobs[r, : len(targets)].gather(1, targets[:, None]).sum())
        return total

    def _logprobs(self, inputs: list[list[int]]) -> torch.Tensor:
        """Log-probabilities (B, T, V) after each token of the inputs, right-padded into one batch
        (causal attention: padding after a row never changes what comes before it)."""
        batch = torch.full((len(inputs), max(len(s) for s in inputs)), self.eos, dtype=torch.long)
        for r, s in enumerate(inputs):
            batch[r, : len(s)] = torch.tensor(s)
        logits, _ = self.model(batch.to(self.device))
        return torch.log_softmax(logits.float(), dim=-1).cpu()

    def _generate(
        self, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None
    ) -> tuple[str, bool]:
        """Greedy text after `prompt`, which is cut from the left when prompt and reply would not
        fit in the context (the returned flag says so)."""
        from lmfoundry.model.generate import generate

        if max_tokens > self.max_length // 2:  # a reply may take at most half the context
            logger.warning(
                "max_tokens=%d is cut to %d: half of %s's context of %d",
                max_tokens,
                self.max_length // 2,
                self.name,
                self.max_length,
            )
            max_tokens = self.max_length // 2
        room = self.max_length - max_tokens
        truncated = len(prompt) > room
        out = generate(
            self.model, prompt[-room:], max_tokens, temperature=temperature, stop_tokens=self.stop_tokens, seed=seed
        )
        return self.tokenizer.decode(out.tokens), truncated

    def complete(self, prompts: list[str], max_tokens: int, stop: list[str] = ()) -> list[str]:
        return [cut_at_stop(self._generate(self.encode(p) or [self.eos], max_tokens)[0], list(stop)) for p in prompts]

    def chat(self, conversations: list[list[dict]], max_tokens: int) -> list[str]:
        return [
            self._generate(self.encode(self.template.render(messages)), max_tokens)[0].strip()
            for messages in conversations
        ]

    def sample(self, conversations: list[list[dict]], max_tokens: int, temperature: float, seed: int) -> list[str]:
        """Sampled replies (the same seed, the same reply)."""
        return [
            self._generate(self.encode(self.template.render(m)), max_tokens, temperature, seed + i)[0].strip()
            for i, m in enumerate(conversations)
        ]

    @torch.no_grad()
    def continuations(
        self, prompt: str, n: int, max_tokens: int, temperature: float, seed: int, stop: list[str] = ()
    ) -> list[tuple[str, int]]:
        """n continuations of a raw prompt, decoded as one batch (sample i seeded with seed + i;
        greedy at temperature 0), each ended at its first stop string, which is not included:
        its row stops there, so a step-by-step search pays for one step at a time. With the tokens
        each generated."""
        from lmfoundry.model.generate import sample_many

        ids = self.encode(prompt) or [self.eos]
        max_tokens = min(max_tokens, self.max_length // 2)
        ids = ids[-(self.max_length - max_tokens) :]
        stops = [s for s in stop if s]

        def finished(tokens: list[int]) -> bool:  # the tail is enough: a stop string is short
            tail = self.tokenizer.decode(tokens[-16:])
            return any(s in tail for s in stops)

        generations = sample_many(
            self.model, ids, n, max_tokens, temperature, [seed + i for i in range(n)], self.stop_tokens,
            finished if stops else None,
        )  # fmt: skip
        return [(cut_at_stop(self.tokenizer.decode(g.tokens), stops), len(g.tokens)) for g in generations]
