"""Verifiers: whether an answer to a task with a checkable answer is right, and whether each step
of a maths solution holds. They decide what synthetic data keeps (align/synth.py) and are the
rewards of evaluation, test-time search and reinforcement learning.

- arithmetic: the answer must equal the expression, compared exactly by sympy;
- algebra: a linear equation's answer, substituted, must satisfy it; an expansion must be
  symbolically equal to the product;
- code: the solution runs in the sandbox (safety/sandbox.py), which only evaluates the tests'
  calls and reports their values; the comparison happens outside it, so a solution cannot forge a
  pass;
- qa: the answer must be a span of the source passage and the question's words found in it.

Each returns None when the answer is right, else why not.
"""

from __future__ import annotations

import re

from lmfoundry.clients.reward import STEP_DELIMITER  # one delimiter for solutions, scorers and training
from lmfoundry.safety.sandbox import run_python

# A solution is its steps, one a line, then "Answer: ..." on a line of its own: the step-level
# scorers (a process reward model, step-level search) cut a solution at STEP_DELIMITER.
ANSWER_PREFIX = "Answer: "


# What `_sympy` parses: sympify evaluates Python, and answers are model output (in serving, a user
# can steer it): only numbers, x, operators and parentheses, short, with few powers (9**9**9**9
# would never finish).
_MATHS = re.compile(r"^[0-9x+\-*/^(). ]{1,128}$")
_MAX_POWERS = 3


def _sympy(text: str):
    import sympy

    if not _MATHS.match(text) or text.replace("^", "**").count("**") > _MAX_POWERS:
        raise ValueError(
            f"not a mathematical expression: {text[:64]!r} (allowed: at most 128 characters of digits, x, "
            f"+ - * / ^ . ( ) and spaces, with at most {_MAX_POWERS} powers)"
        )
    try:
        return sympy.sympify(text.replace("^", "**"), evaluate=True)
    except (sympy.SympifyError, SyntaxError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"not a mathematical expression: {text!r} ({type(e).__name__})") from None


def final_answer(reply: str) -> str:
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
        expected, given = _sympy(sample["expression"]), _sympy(final_answer(sample["answer"]))
    except ValueError as e:
        return str(e)
    if given.free_symbols:
        return f"{sample['answer']!r} is not a number"
    return None if sympy.simplify(expected - given) == 0 else f"{sample['answer']!r} is not {expected}"


def verify_algebra(sample: dict) -> str | None:
    import sympy

    x = sympy.Symbol("x")
    try:
        given = _sympy(re.sub(r"^\s*x\s*=\s*", "", final_answer(sample["answer"])) or "nan")
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
    passage, answer = sample["passage"], final_answer(sample["answer"])
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


def answer_of(text: str) -> str | None:
    """The final answer of a solution written in steps: what follows ANSWER_PREFIX on the first
    line that starts with it, or None."""
    for line in text.split(STEP_DELIMITER):
        if line.strip().startswith(ANSWER_PREFIX.strip()):
            return line.strip()[len(ANSWER_PREFIX.strip()) :].strip() or None
    return None


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


def verify(sample: dict, sandbox_timeout_s: float = 10.0) -> str | None:
    """The verifier of the sample's kind."""
    kind = sample.get("kind")
    if kind == "arithmetic":
        return verify_arithmetic(sample)
    if kind == "algebra":
        return verify_algebra(sample)
    if kind == "code":
        return verify_code(sample, sandbox_timeout_s)
    if kind == "qa":
        return verify_qa(sample)
    raise ValueError(f"no verifier for kind {kind!r}; allowed: arithmetic, algebra, code, qa")


# The questions of the synthetic maths tasks (align/synth.py), read back into the problem a
# verifier checks: serving's `verifier` scorer gets the question from the user's message.
_QUESTIONS = (
    (re.compile(r"^Compute ([0-9+\-*() ]{1,96})\.$"), lambda m: {"kind": "arithmetic", "expression": m[1]}),
    (
        re.compile(r"^Solve for x: ([0-9x*+\-() ]{1,96}=[0-9x*+\-() ]{1,96})$"),
        lambda m: {"kind": "algebra", "task": "solve", "equation": m[1]},
    ),
    (
        re.compile(r"^Expand (\([0-9x*+\-() ]{1,96}\))\.$"),
        lambda m: {"kind": "algebra", "task": "expand", "product": m[1]},
    ),
)
QUESTION_FORMS = ("Compute EXPRESSION.", "Solve for x: EQUATION", "Expand (PRODUCT).")


def problem_of(question: str) -> dict | None:
    """The arithmetic or algebra problem a question in one of QUESTION_FORMS states, or None."""
    text = question.strip()
    for pattern, problem in _QUESTIONS:
        match = pattern.match(text)
        if match:
            return {**problem(match), "question": text}
    return None


class VerifierScorer:
    """A scorer of test-time search from the verifier of one problem: a solution scores 1 when
    its answer verifies, else 0; a partial solution, by the fraction of its steps that hold (half
    that when it ends in a wrong answer). An oracle: the upper bound of a learned reward model."""

    def __init__(self, problem: dict):
        self.problem = problem

    def score(self, prompt: str, solutions: list[str]) -> list[float]:
        return [float(verify({**self.problem, "answer": s}) is None) for s in solutions]

    def score_steps(self, prompt: str, partials: list[list[str]]) -> list[float]:
        scores = []
        for steps in partials:
            work = [s for s in steps if not s.startswith(ANSWER_PREFIX.strip())]
            held = [step_is_correct(self.problem, s) for s in work]
            answer = steps[-1] if steps[-1].startswith(ANSWER_PREFIX.strip()) else None
            right = answer is not None and verify({**self.problem, "answer": answer}) is None
            scores.append((sum(held) / len(held) if held else 0.0) * (1.0 if answer is None or right else 0.5))
        return scores
