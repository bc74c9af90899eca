"""The code tasks of synthetic data: parametrised families of small functions, each with a
reference solution written one statement a line (the solution's steps) and unit tests whose
expected values come from a trusted implementation here, on inputs drawn by the seeded generator.

A family is a function name and statement pattern with parameters (a divisor, a shift, a base...),
so the space of distinct tasks is the families times their parameters times the test inputs, not a
fixed list a model could memorise.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str  # the function's name, with {k} filled by the parameter
    prompt: str  # the task, with {k} and {name}
    solution: tuple[str, ...]  # the reference solution's lines; {k} and {name} filled
    params: tuple[int, ...]  # values of k
    reference: Callable  # reference(k) -> the trusted implementation
    inputs: Callable[[random.Random], tuple]  # arguments of one test call


def _ints(rng: random.Random, low: int = -20, high: int = 40, most: int = 8) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(0, most))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 9)))


FAMILIES = (
    Family(
        "sum_multiples_of_{k}",
        "Write {name}(xs) returning the sum of the elements of the list xs that are divisible by {k}.",
        (
            "def {name}(xs):",
            "    total = 0",
            "    for x in xs:",
            "        if x % {k} == 0:",
            "            total += x",
            "    return total",
        ),
        (2, 3, 4, 5, 6, 7, 9, 10),
        lambda k: lambda xs: sum(x for x in xs if x % k == 0),
        lambda rng: (_ints(rng),),
    ),
    Family(
        "count_longer_than_{k}",
        "Write {name}(words) returning how many strings in the list words are longer than {k} characters.",
        (
            "def {name}(words):",
            "    count = 0",
            "    for w in words:",
            "        if len(w) > {k}:",
            "            count += 1",
            "    return count",
        ),
        (1, 2, 3, 4, 5, 6),
        lambda k: lambda words: sum(len(w) > k for w in words),
        lambda rng: ([_word(rng) for _ in range(rng.randint(0, 6))],),
    ),
    Family(
        "rotate_left_{k}",
        "Write {name}(xs) returning the list xs rotated left by {k} places (wrapping around).",
        (
            "def {name}(xs):",
            "    if not xs:",
            "        return []",
            "    shift = {k} % len(xs)",
            "    return xs[shift:] + xs[:shift]",
        ),
        (1, 2, 3, 4, 5),
        lambda k: lambda xs: xs[k % len(xs) :] + xs[: k % len(xs)] if xs else [],
        lambda rng: (_ints(rng, 0, 9),),
    ),
    Family(
        "power_sum_{k}",
        "Write {name}(n) returning 1**{k} + 2**{k} + ... + n**{k} for a non-negative integer n (0 for n = 0).",
        (
            "def {name}(n):",
            "    total = 0",
            "    for i in range(1, n + 1):",
            "        total += i ** {k}",
            "    return total",
        ),
        (1, 2, 3, 4),
        lambda k: lambda n: sum(i**k for i in range(1, n + 1)),
        lambda rng: (rng.randint(0, 30),),
    ),
    Family(
        "caesar_{k}",
        "Write {name}(s) shifting every lowercase letter of s forward by {k} places in the alphabet "
        "(z wraps to a), leaving other characters unchanged.",
        (
            "def {name}(s):",
            "    out = []",
            "    for c in s:",
            "        if 'a' <= c <= 'z':",
            "            c = chr((ord(c) - ord('a') + {k}) % 26 + ord('a'))",
            "        out.append(c)",
            "    return ''.join(out)",
        ),
        (1, 3, 5, 7, 13, 25),
        lambda k: lambda s: "".join(chr((ord(c) - 97 + k) % 26 + 97) if "a" <= c <= "z" else c for c in s),
        lambda rng: (" ".join(_word(rng) for _ in range(rng.randint(0, 3))) + rng.choice(["", "!", " Ray"]),),
    ),
    Family(
        "take_every_{k}",
        "Write {name}(xs) returning the elements of the list xs at positions 0, {k}, 2*{k}, ... in order.",
        ("def {name}(xs):", "    return xs[::{k}]"),
        (2, 3, 4, 5),
        lambda k: lambda xs: xs[::k],
        lambda rng: (_ints(rng, 0, 99, 12),),
    ),
    Family(
        "digits_base_{k}",
        "Write {name}(n) returning the digits of the non-negative integer n in base {k}, most significant "
        "first ([0] for n = 0).",
        (
            "def {name}(n):",
            "    if n == 0:",
            "        return [0]",
            "    digits = []",
            "    while n > 0:",
            "        digits.append(n % {k})",
            "        n //= {k}",
            "    return digits[::-1]",
        ),
        (2, 3, 5, 7, 8, 16),
        lambda k: lambda n: _digits(n, k),
        lambda rng: (rng.randint(0, 5000),),
    ),
    Family(
        "clamp_to_{k}",
        "Write {name}(xs) returning the list xs with every element above {k} replaced by {k} and every "
        "element below -{k} replaced by -{k}.",
        ("def {name}(xs):", "    return [max(-{k}, min({k}, x)) for x in xs]"),
        (1, 5, 10, 15, 20),
        lambda k: lambda xs: [max(-k, min(k, x)) for x in xs],
        lambda rng: (_ints(rng, -30, 30),),
    ),
)


def _digits(n: int, base: int) -> list[int]:
    digits = []
    while n > 0:
        digits.append(n % base)
        n //= base
    return digits[::-1] or [0]


def space_size() -> int:
    """How many distinct functions the families describe (before test inputs are drawn)."""
    return sum(len(f.params) for f in FAMILIES)


def gen_code(rng: random.Random, tests: int = 4) -> dict:
    """One code task: a family and parameter drawn by `rng`, tests on inputs drawn by `rng` whose
    expected values come from the trusted reference implementation."""
    family = rng.choice(FAMILIES)
    k = rng.choice(family.params)
    name = family.name.format(k=k)
    reference = family.reference(k)
    calls, seen = [], set()
    for _ in range(tests * 4):  # distinct calls, as many as asked when the input space allows
        args = family.inputs(rng)
        call = f"{name}({', '.join(map(repr, args))})"
        if call not in seen:
            seen.add(call)
            calls.append(f"assert {call} == {reference(*args)!r}")
        if len(calls) == tests:
            break
    steps = [line.format(k=k, name=name) for line in family.solution]
    return {
        "kind": "code",
        "question": family.prompt.format(k=k, name=name),
        "function": name,
        "family": family.name,
        "steps": steps,
        "answer": "\n".join(steps),
        "tests": "\n".join(calls),
    }
