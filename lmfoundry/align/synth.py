"""Verified synthetic data: a generated sample enters the dataset only after its verifier passes it.

    lmfoundry synth configs/synth.yaml --output work/synth

Generators (seeded) and their verifiers:
- `arithmetic`: expressions over integers; the answer must equal the expression, compared
  exactly by sympy;
- `algebra`: linear equations (the answer, substituted, must satisfy the equation) and products
  to expand (the answer must be symbolically equal to the product);
- `code`: small functions with unit tests; the solution runs in the sandbox (safety/sandbox.py),
  which only evaluates the tests' calls and reports their values; the verifier compares them with
  the expected values outside it, so a solution cannot forge a pass;
- `qa`: question-answer pairs from curated documents ("X is Y." becomes "What is X?"); the answer
  must be a span of the source passage and the question's words must be found in it.

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
from lmfoundry.safety.sandbox import run_python

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


# --- verifiers ----------------------------------------------------------------------------------


def _sympy(text: str):
    import sympy

    try:
        return sympy.sympify(text.replace("^", "**"), evaluate=True)
    except (sympy.SympifyError, SyntaxError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"not a mathematical expression: {text!r} ({type(e).__name__})") from None


def _final_answer(reply: str) -> str:
    """The answer in a model's reply: after 'answer:' or '=' if present, else the last line."""
    text = reply.strip()
    for marker in ("answer:", "answer is", "="):
        at = text.lower().rfind(marker)
        if at >= 0:
            text = text[at + len(marker) :]
            break
    return text.strip().splitlines()[0].strip().rstrip(".") if text.strip() else ""


def verify_arithmetic(sample: dict) -> str | None:
    """None when correct, else why not."""
    import sympy

    try:
        expected, given = _sympy(sample["expression"]), _sympy(_final_answer(sample["answer"]))
    except ValueError as e:
        return str(e)
    if given.free_symbols:
        return f"{sample['answer']!r} is not a number"
    return None if sympy.simplify(expected - given) == 0 else f"{sample['answer']!r} is not {expected}"


def verify_algebra(sample: dict) -> str | None:
    import sympy

    x = sympy.Symbol("x")
    try:
        given = _sympy(re.sub(r"^\s*x\s*=\s*", "", _final_answer(sample["answer"])) or "nan")
    except ValueError as e:
        return str(e)
    if sample["task"] == "solve":
        left, right = sample["equation"].split("=")
        residual = sympy.simplify(_sympy(left).subs(x, given) - _sympy(right))
        return None if residual == 0 else f"x = {given} leaves {left} - ({right}) = {residual}"
    difference = sympy.expand(_sympy(sample["product"]) - given)
    return None if difference == 0 else f"{given} differs from {sample['product']} by {difference}"


# The candidate's process is untrusted: it may print "PASS", exit 0 early, patch any checker it can
# see or write files. So it only evaluates the test calls and reports their values as JSON; the
# expected values never enter it, and the comparison happens here.
_DRIVER = """
import json, sys
request = json.loads(sys.stdin.readline())  # the calls, and the nonce marking the result line
namespace = {"__name__": "candidate"}
exec(compile(open("candidate.py", encoding="utf-8").read(), "candidate.py", "exec"), namespace)
values = []
for call in request["calls"]:
    try:
        values.append({"value": json.loads(json.dumps(eval(call, namespace)))})
    except Exception as e:
        values.append({"error": type(e).__name__ + ": " + str(e)[:200]})
sys.stdout.write("\\n" + request["nonce"] + " " + json.dumps(values) + "\\n")
"""


def code_checks(tests: str) -> list[tuple[str, str, object]]:
    """The sample's tests as (call source, how to compare, expected value): each line must be
    `assert CALL == LITERAL`, `assert CALL` or `assert not CALL`."""
    import ast

    checks = []
    for statement in ast.parse(tests).body:
        if not isinstance(statement, ast.Assert):
            raise ValueError(f"code tests: only assert statements are allowed, not {ast.unparse(statement)!r}")
        test = statement.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            checks.append((ast.unparse(test.left), "equal", _literal(test.comparators[0])))
        elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            checks.append((ast.unparse(test.operand), "false", None))
        else:
            checks.append((ast.unparse(test), "true", None))
    return checks


def _literal(node):
    import ast

    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"code tests: the expected value must be a literal, not {ast.unparse(node)!r}") from None


def _same(value, expected) -> bool:
    """Equal as JSON text: True is not 1, 1.0 is not 1, a tuple compares as a list."""
    import json

    return json.dumps(value, sort_keys=True) == json.dumps(expected, sort_keys=True)


def _check_failure(call: str, how: str, expected, got: dict) -> str | None:
    if "error" in got:
        return f"{call} raised {got['error']}"
    value = got.get("value")
    if how == "equal" and not _same(value, expected):
        return f"{call} returned {value!r}, expected {expected!r}"
    if how == "true" and not value:
        return f"{call} returned {value!r}, expected a true value"
    if how == "false" and value:
        return f"{call} returned {value!r}, expected a false value"
    return None


def verify_code(sample: dict, timeout_s: float) -> str | None:
    import json
    import secrets

    checks = code_checks(sample["tests"])
    nonce = secrets.token_hex(16)
    request = json.dumps({"nonce": nonce, "calls": [call for call, _, _ in checks]})
    result = run_python(
        _DRIVER,
        timeout_s=timeout_s,
        cpu_s=max(1, int(timeout_s)),
        files={"candidate.py": sample["answer"]},
        stdin=request.encode() + b"\n",
    )
    if result.killed:
        return f"killed by the sandbox ({result.killed})"
    reports = [line[len(nonce) + 1 :] for line in result.stdout.splitlines() if line.startswith(nonce + " ")]
    if len(reports) != 1:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the tests failed: no single result from the test run ({last[:200]})"
    try:
        values = json.loads(reports[0])
        if not isinstance(values, list) or len(values) != len(checks) or not all(isinstance(v, dict) for v in values):
            raise ValueError("not one value per test")
    except ValueError:
        return "the tests failed: the test run's result is malformed"
    for (call, how, expected), got in zip(checks, values):
        failure = _check_failure(call, how, expected, got)
        if failure:
            return f"the tests failed: {failure}"[:300]
    return None


STOP = {"the", "a", "an", "is", "are", "what", "of", "in", "on", "and", "to", "was", "does", "do"}


def verify_qa(sample: dict) -> str | None:
    passage, answer = sample["passage"], _final_answer(sample["answer"])
    if not answer:
        return "empty answer"
    if answer.lower() not in passage.lower():
        return "the answer is not supported by the passage (not a span of it)"
    words = [w for w in re.findall(r"\w+", sample["question"].lower()) if w not in STOP]
    missing = [w for w in words if w not in passage.lower()]
    if missing:
        return f"the question asks about {missing}, which the passage does not mention"
    if answer.lower() in sample["question"].lower():
        return "the answer is given away by the question"
    return None


# --- generators ---------------------------------------------------------------------------------

# A solution is its steps, one a line, then "Answer: ..." on a line of its own: the step-level
# scorers (a process reward model, step-level search) cut a solution at STEP_DELIMITER.
STEP_DELIMITER = "\n"
ANSWER_PREFIX = "Answer: "


def with_steps(steps: list[str], answer: str) -> dict:
    return {"steps": steps, "answer": answer, "solution": STEP_DELIMITER.join([*steps, ANSWER_PREFIX + answer])}


def split_steps(solution: str) -> list[str]:
    """A solution's steps: its non-empty lines before the answer line."""
    lines = [line.strip() for line in solution.split(STEP_DELIMITER) if line.strip()]
    return [line for line in lines if not line.lower().startswith(ANSWER_PREFIX.strip().lower())]


def step_is_correct(sample: dict, step: str) -> bool:
    """Whether one step of a maths solution holds: `lhs = rhs` equal as expressions (arithmetic,
    expanding), or, for an equation to solve, with the same solution as the original equation. A
    step that is not of that form is not correct."""
    import sympy

    if step.count("=") != 1:
        return False
    left, right = step.split("=")
    try:
        lhs, rhs = _sympy(left), _sympy(right)
    except ValueError:
        return False
    if sample["kind"] == "algebra" and sample["task"] == "solve":
        x = sympy.Symbol("x")
        original_left, original_right = sample["equation"].split("=")
        wanted = sympy.solve(_sympy(original_left) - _sympy(original_right), x)
        try:
            return sympy.solve(lhs - rhs, x) == wanted
        except (NotImplementedError, TypeError):
            return False
    return sympy.simplify(lhs - rhs) == 0


def step_labels(sample: dict, solution: str) -> list[bool]:
    """Each step of `solution` checked on its own (maths kinds): the ground truth that automatic
    step labels, estimated from completions, are measured against."""
    if sample["kind"] not in ("arithmetic", "algebra"):
        raise ValueError(f"step labels are checked for arithmetic and algebra, not {sample['kind']!r}")
    return [step_is_correct(sample, step) for step in split_steps(solution)]


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


def verify(sample: dict, cfg: SynthConfig) -> str | None:
    if sample["kind"] == "arithmetic":
        return verify_arithmetic(sample)
    if sample["kind"] == "algebra":
        return verify_algebra(sample)
    if sample["kind"] == "code":
        return verify_code(sample, cfg.sandbox_timeout_s)
    return verify_qa(sample)


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
        reason = verify(s, cfg)
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
