"""Verified synthetic data: a generated sample enters the dataset only after its verifier passes it.

    lmfoundry synth configs/synth.yaml --output work/synth

Generators (seeded): `arithmetic` and `algebra` (solutions in steps, one a line, that
reasoning/verifiers.py checks one by one), `code` (parametrised function families with unit tests,
align/code_tasks.py) and `qa` (question-answer pairs from curated documents: "X is Y." becomes
"What is X?"). Every sample passes its verifier (reasoning/verifiers.py) or is rejected.

Answers come from the generator itself, or from a `solver` model (any checkpoint or
OpenAI-compatible endpoint), which is where verification earns its keep: a wrong answer is
rejected with the reason, like curation's rejects, never silently dropped.
"""

from __future__ import annotations

import random
import re
import time

from pydantic import Field

from lmfoundry.align.code_tasks import gen_code
from lmfoundry.align.pairs import ModelRef, open_model
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.corpus import read_documents
from lmfoundry.platform.log import get_logger
from lmfoundry.reasoning.verifiers import ANSWER_PREFIX, STEP_DELIMITER, verify

logger = get_logger(__name__)

KINDS = ("arithmetic", "algebra", "code", "qa")


class SynthConfig(StageConfig):
    output: str
    kinds: dict[str, int] = Field(
        {"arithmetic": 20, "algebra": 20, "code": 6},
        description="samples to generate per kind: arithmetic, algebra, code, qa",
    )
    documents: str | None = Field(None, description="a curate output (kept/ Parquet) or a JSONL with 'text': qa")
    solver: ModelRef | None = Field(None, description="answers from this model instead of the generator's own")
    max_tokens: int = Field(128, ge=1)
    sandbox_timeout_s: float = Field(10.0, gt=0)
    seed: int = 0
    overwrite: bool = False


# --- generators ---------------------------------------------------------------------------------


def with_steps(steps: list[str], answer: str) -> dict:
    return {"steps": steps, "answer": answer, "solution": STEP_DELIMITER.join([*steps, ANSWER_PREFIX + answer])}


def gen_arithmetic(rng: random.Random) -> dict:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
    op = rng.choice(["+", "-", "*"])
    apply = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}[op]
    if rng.random() < 0.5:
        expression, first = f"({a} {op} {b}) * {c}", apply(a, b)
        steps = [f"{a} {op} {b} = {first}", f"{first} * {c} = {first * c}"]
    elif op != "*":  # precedence: the product binds first
        expression, first = f"{a} {op} {b} * {c}", b * c
        steps = [f"{b} * {c} = {first}", f"{a} {op} {first} = {apply(a, first)}"]
    else:
        expression, first = f"{a} * {b} * {c}", a * b
        steps = [f"{a} * {b} = {first}", f"{first} * {c} = {first * c}"]
    value = steps[-1].rsplit("= ", 1)[1]
    return {
        "kind": "arithmetic",
        "question": f"Compute {expression}.",
        "expression": expression,
        **with_steps(steps, value),
    }


def gen_algebra(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        a, x, b = rng.randint(2, 12), rng.randint(-10, 10), rng.randint(-20, 20)
        right = a * x + b
        equation = f"{a}*x + {b} = {right}"
        steps = [f"{a}*x = {right} - ({b})", f"{a}*x = {right - b}", f"x = {right - b}/{a}", f"x = {x}"]
        return {
            "kind": "algebra",
            "task": "solve",
            "question": f"Solve for x: {equation}",
            "equation": equation,
            **with_steps(steps, str(x)),
        }
    p, q = rng.randint(-9, 9), rng.randint(-9, 9)
    product = f"(x + {p})*(x + {q})"
    distributed = f"x**2 + {q}*x + {p}*x + {p * q}"
    answer = f"x**2 + {p + q}*x + {p * q}"
    return {
        "kind": "algebra",
        "task": "expand",
        "question": f"Expand {product}.",
        "product": product,
        **with_steps([f"{product} = {distributed}", f"{distributed} = {answer}"], answer),
    }


SENTENCE = re.compile(r"(?:^|(?<=[.!?]\s))([A-Z][\w\- ]{2,40}?) (is|are) ([^.!?]{3,80})\.")


VAGUE = {
    "this",
    "that",
    "it",
    "there",
    "these",
    "those",
    "then",
    "here",
    "which",
    "what",
    "one",
    "such",
    "if",
    "when",
    "while",
    "because",
    "although",
    "so",
    "but",
    "and",
    "or",
}


def qa_candidates(texts: list[str]) -> list[dict]:
    found = []
    for text in texts:
        text = " ".join(text.split())
        for match in SENTENCE.finditer(text):
            subject, verb, predicate = match.groups()
            if len(subject.split()) > 5 or subject.split()[0].lower() in VAGUE:  # "This is ..." asks nothing
                continue
            found.append(
                {
                    "kind": "qa",
                    "question": f"What {verb} {subject[0].lower() + subject[1:]}?",
                    "answer": predicate.strip(),
                    "passage": match.group(0).strip() if len(text) > 600 else text.strip(),
                }
            )
    return found


# --- the stage ---------------------------------------------------------------------------------


def solve(samples: list[dict], ref: ModelRef, max_tokens: int) -> None:
    """Replace each sample's answer by the solver model's reply (the generator's is kept as
    `reference_answer`)."""
    model = open_model(ref)
    instructions = {
        "arithmetic": "Reply with the number only.",
        "algebra": "Reply with the answer only.",
        "code": "Reply with the Python function only, no explanation.",
        "qa": "Answer with the words of the passage.",
    }
    conversations = []
    for s in samples:
        context = f"Passage: {s['passage']}\n\n" if s["kind"] == "qa" else ""
        conversations.append([{"role": "user", "content": f"{context}{s['question']} {instructions[s['kind']]}"}])
    for s, reply in zip(samples, model.chat(conversations, max_tokens)):
        s["reference_answer"], s["answer"] = s["answer"], reply
        s["solver"] = model.name


def run_synth(cfg: SynthConfig) -> dict:
    unknown = sorted(set(cfg.kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"synth.kinds {unknown}; allowed: {list(KINDS)}")
    if cfg.kinds.get("qa") and not cfg.documents:
        raise ValueError("synth kind qa needs documents (a curate output or a JSONL with 'text')")
    out = storage.normalize(cfg.output)
    if not storage.prepare_output(out, cfg.overwrite):
        logger.info("synth: %s is already committed; skipping (set overwrite=true to redo)", out)
        return storage.read_json(storage.join(out, "card.json"))
    started = time.time()
    rng = random.Random(cfg.seed)
    samples = []
    for kind, count in cfg.kinds.items():
        if kind == "arithmetic":
            samples += [gen_arithmetic(rng) for _ in range(count)]
        elif kind == "algebra":
            samples += [gen_algebra(rng) for _ in range(count)]
        elif kind == "code":
            samples += [gen_code(rng) for _ in range(count)]
        else:
            found = qa_candidates([d["text"] for d in read_documents(cfg.documents, limit=2000)])
            rng.shuffle(found)
            samples += found[:count]
    for i, s in enumerate(samples):
        s["id"] = f"{s['kind']}-{i:05d}"
    if cfg.solver is not None:
        solve(samples, cfg.solver, cfg.max_tokens)
    kept, rejected = [], []
    for s in samples:
        reason = verify(s, cfg.sandbox_timeout_s)
        (rejected if reason else kept).append({**s, "reason": reason} if reason else s)
    counts = {
        k: {"generated": sum(s["kind"] == k for s in samples), "kept": sum(s["kind"] == k for s in kept)}
        for k in cfg.kinds
    }
    for name, rows in (("kept.jsonl", kept), ("rejected.jsonl", rejected)):
        storage.write_jsonl_atomic(storage.join(out, name), rows)
    card = {
        "samples": len(samples),
        "kept": len(kept),
        "rejected": len(rejected),
        "by_kind": counts,
        "solver": samples[0].get("solver") if samples and cfg.solver else "generator",
        "seconds": round(time.time() - started, 2),
    }
    storage.write_json_atomic(storage.join(out, "card.json"), card)
    fingerprint = storage.fingerprint(out, ["kept.jsonl", "rejected.jsonl"])
    storage.commit(out, "synth", {"card": "card.json", "fingerprint": fingerprint})
    logger.info(
        "synth: %d generated, %d verified and kept, %d rejected (%s)", len(samples), len(kept), len(rejected), counts
    )
    return card
