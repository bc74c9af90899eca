"""Sequence-level distillation data: a teacher answers a pool of prompts, and its answers become
supervised fine-tuning conversations for a smaller model.

    lmfoundry distill configs/distill.yaml --output work/distill

The teacher is a checkpoint run in process or any OpenAI-compatible endpoint (`ModelRef`, as for
preference pairs). Each prompt goes through:

1. exact dedup of the prompt (the same normalised conversation is asked once);
2. the teacher, greedy by default (`temperature`, with a seed per prompt otherwise); a prompt the
   teacher fails on (an error status, a response that is not the API's JSON, larger than
   `max_response_bytes` or slower than `timeout_s`, an empty reply) is counted by kind and the
   run goes on;
3. the harm scorer (safety/harm.py, as curation uses it) on the answer: a harmful answer is
   refused;
4. exact dedup of the answer (normalised text): a teacher that gives one stock reply to many
   prompts would otherwise teach it by rote.

Output: `sft.jsonl`, one `{"messages": [...]}` per kept answer in the OpenAI chat format that
`lmfoundry sft` reads; `rejected.jsonl`, every prompt not kept with its reason; `card.json`, the
counts; the manifest with the counts and a fingerprint of the two data files, which are the same
bytes for the same prompts, teacher and seed.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from lmfoundry.align.pairs import ModelRef
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger
from lmfoundry.safety.harm import HarmConfig, HarmScorer

logger = get_logger(__name__)


class DistillConfig(StageConfig):
    prompts: str = Field(..., description="JSONL: each line {'prompt': text} or {'messages': [...]}, optional 'id'")
    output: str
    teacher: ModelRef
    teacher_system_prompt: str | None = Field(
        None, description="a system message the teacher is asked with, not written to the data"
    )
    max_tokens: int = Field(256, ge=1, le=32768)
    temperature: float = Field(0.0, ge=0, le=2, description="0: greedy; above: sampled with seed + prompt index")
    seed: int = 0
    concurrency: int = Field(8, ge=1, le=256, description="requests in flight to an endpoint (a checkpoint: 1)")
    timeout_s: float = Field(120.0, gt=0, description="an endpoint's whole response, per prompt")
    max_response_bytes: int = Field(1 << 20, ge=1024, description="an endpoint response larger than this is an error")
    max_answer_chars: int = Field(20_000, ge=1, description="a longer answer is an error, not data")
    max_prompts: int = Field(100_000, ge=1, description="a larger pool is refused")
    max_prompt_chars: int = Field(32_000, ge=1, description="a prompt (all its messages) longer than this is refused")
    dedup_answers: bool = Field(True, description="drop an answer whose normalised text an earlier kept one has")
    harm: HarmConfig = HarmConfig()
    overwrite: bool = False


class PromptMessage(StageConfig):
    role: Literal["system", "developer", "user", "assistant"]
    content: str


class PromptRow(StageConfig):
    """One line of the prompt pool."""

    id: str | int | None = None
    prompt: str | None = None
    messages: list[PromptMessage] | None = Field(None, min_length=1, max_length=64)

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text) and 'messages' (a chat)")
        if self.messages is not None and self.messages[-1].role != "user":
            raise ValueError(f"the last message must be the user's, not {self.messages[-1].role!r}")
        return self

    def chat(self) -> list[dict]:
        if self.messages is None:
            return [{"role": "user", "content": self.prompt}]
        return [m.model_dump() for m in self.messages]


def read_prompt_pool(uri: str, max_prompts: int, max_chars: int) -> list[dict]:
    """[{id, messages}] in file order; any malformed line is an error naming the file and line."""
    rows = []
    for n, raw in storage.numbered_jsonl(uri):
        if len(rows) == max_prompts:
            raise ValueError(f"{uri}: more than max_prompts={max_prompts} prompts")
        try:
            row = PromptRow.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "line"
            raise ValueError(
                f"{uri}:{n}: {where}: {first['msg']} (allowed keys: id, prompt or messages "
                "[{role: system|developer|user|assistant, content}])"
            ) from None
        messages = row.chat()
        if sum(len(m["content"]) for m in messages) > max_chars:
            raise ValueError(f"{uri}:{n}: the prompt is longer than max_prompt_chars={max_chars}")
        prompt_id = (
            str(row.id) if row.id is not None else hashlib.sha256(json.dumps(messages).encode()).hexdigest()[:16]
        )
        rows.append({"id": prompt_id, "messages": messages})
    if not rows:
        raise ValueError(f"{uri} holds no prompts")
    return rows


def open_teacher(cfg: DistillConfig):
    """The teacher as an evaluation model (clients/): `sample(conversations, max_tokens,
    temperature, seed)` by checkpoint or by endpoint, the endpoint bounded by the config."""
    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.clients.openai import EndpointModel
    from lmfoundry.platform import checkpoint

    ref = cfg.teacher
    if ref.url is not None:
        return EndpointModel(
            ref.url,
            ref.model,
            ref.api_key(),
            concurrency=1,  # one conversation per call; the prompts are spread over threads here
            timeout_s=cfg.timeout_s,
            max_response_bytes=cfg.max_response_bytes,
        )
    with checkpoint.opened(ref.checkpoint) as (local, _):
        return CheckpointModel(local)  # loaded whole into memory: a temporary copy can go


def teacher_name(ref: ModelRef) -> str:
    return ref.checkpoint if ref.checkpoint else f"{ref.url} ({ref.model})"


def ask(teacher, messages: list[dict], index: int, cfg: DistillConfig) -> tuple[str | None, str | None]:
    """(answer, None) or (None, "kind: detail") for one prompt: a teacher's failure is its result."""
    from lmfoundry.clients.checkpoint import Blocked

    if cfg.teacher_system_prompt:
        messages = [{"role": "system", "content": cfg.teacher_system_prompt}, *messages]
    try:
        answer = teacher.sample([messages], cfg.max_tokens, cfg.temperature, cfg.seed + index)[0]
    except Exception as e:  # an endpoint's failure on one prompt, whatever it is, is counted, not fatal
        return None, f"{type(e).__name__}: {str(e)[:300]}"
    if isinstance(answer, Blocked):
        return None, "Blocked: the endpoint's guardrails withheld the reply"
    if not isinstance(answer, str) or not answer.strip():
        return None, "EmptyReply: the teacher's reply is empty"
    if len(answer) > cfg.max_answer_chars:
        return None, f"TooLong: the reply has {len(answer)} characters, more than max_answer_chars"
    return answer.strip(), None


def conversation_text(messages: list[dict]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def run_distill(cfg: DistillConfig, exact_key: Callable[[str], int]) -> dict:
    """`exact_key(text)`: the exact-dedup key of a text (the one curation uses, wired in by
    jobs/distill.py: stages do not import each other)."""
    out = storage.normalize(cfg.output)
    prompts = read_prompt_pool(cfg.prompts, cfg.max_prompts, cfg.max_prompt_chars)
    if not storage.prepare_output(out, cfg.overwrite):
        logger.info("distill: %s is already committed; skipping (set overwrite=true to redo)", out)
        return storage.read_json(storage.join(out, "card.json"))
    started = time.time()
    outcome: list[dict] = [{"id": p["id"], "messages": p["messages"]} for p in prompts]
    seen_prompts: set[int] = set()
    to_ask = []
    for i, p in enumerate(prompts):
        key = exact_key(conversation_text(p["messages"]))
        if key in seen_prompts:
            outcome[i]["reason"] = "duplicate_prompt"
        else:
            seen_prompts.add(key)
            to_ask.append(i)
    teacher = open_teacher(cfg)
    threads = cfg.concurrency if cfg.teacher.url is not None else 1
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        replies = list(pool.map(lambda i: ask(teacher, prompts[i]["messages"], i, cfg), to_ask))
    answered = []
    errors: Counter[str] = Counter()
    for i, (answer, error) in zip(to_ask, replies):
        if error is not None:
            errors[error.split(":", 1)[0]] += 1
            outcome[i].update(reason="error", detail=error)
        else:
            outcome[i]["answer"] = answer
            answered.append(i)
    scorer = HarmScorer(cfg.harm) if cfg.harm.enabled else None
    scores = scorer([outcome[i]["answer"] for i in answered]) if scorer else [0.0] * len(answered)
    seen_answers: set[int] = set()
    for i, score in zip(answered, scores):
        if scorer is not None and scorer.harmful(score):
            outcome[i].update(reason="harm", detail=f"harm score {score:.3f} >= {cfg.harm.threshold}")
            continue
        key = exact_key(outcome[i]["answer"])
        if cfg.dedup_answers and key in seen_answers:
            outcome[i].update(reason="duplicate_answer", detail="an earlier prompt's kept answer has the same text")
            continue
        seen_answers.add(key)
    kept = [o for o in outcome if "reason" not in o]
    rejected = [o for o in outcome if "reason" in o]
    sft = [{"messages": [*o["messages"], {"role": "assistant", "content": o["answer"]}]} for o in kept]
    storage.write_jsonl_atomic(storage.join(out, "sft.jsonl"), sft)
    storage.write_jsonl_atomic(storage.join(out, "rejected.jsonl"), rejected)
    reasons = Counter(o["reason"] for o in rejected)
    counts = {
        "prompts": len(prompts),
        "duplicate_prompts": reasons["duplicate_prompt"],
        "asked": len(to_ask),
        "answered": len(answered),
        "errors": sum(errors.values()),
        "refused_by_harm": reasons["harm"],
        "duplicates": reasons["duplicate_answer"],
        "kept": len(kept),
    }
    card = {
        "teacher": teacher_name(cfg.teacher),
        "counts": counts,
        "errors_by_kind": dict(sorted(errors.items())),
        "seconds": round(time.time() - started, 2),
    }
    storage.write_json_atomic(storage.join(out, "card.json"), card)
    fingerprint = storage.fingerprint(out, ["sft.jsonl", "rejected.jsonl"])
    storage.commit(
        out,
        "distill",
        {"card": "card.json", "counts": counts, "errors_by_kind": card["errors_by_kind"], "fingerprint": fingerprint},
    )
    logger.info("distill: %s (errors by kind: %s)", counts, card["errors_by_kind"])
    return {**card, "fingerprint": fingerprint}
