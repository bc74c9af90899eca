"""Needle in a haystack: can the model find one fact planted at a given depth of a long context?

A grid of context lengths (in the model's tokens) x needle depths (0 = the start, 1 = the end);
each cell averages `trials` needles (a random place and a random five-digit code each). Two ways
to ask:

- `generate` (chat models): the haystack and a question go to the model as one user message;
  the needle is found when the reply holds the code.
- `loglikelihood` (base models, which follow no questions): after the haystack and an answer
  prefix, the true code must be more likely than each of `distractors` random codes.

The report is the heat map (length x depth -> retrieval rate) and the *effective context
length*: the longest tested length up to which every length's retrieval rate, averaged over
depths, stays at or above the threshold (0 when the shortest already fails).
"""

from __future__ import annotations

import random

from pydantic import Field

from lmfoundry.clients.checkpoint import EvalModel
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig

CITIES = [
    "Lisbon",
    "Nairobi",
    "Osaka",
    "Quito",
    "Tromso",
    "Hanoi",
    "Accra",
    "Tbilisi",
    "Perth",
    "Bergen",
    "Cusco",
    "Dakar",
    "Lyon",
    "Porto",
    "Riga",
    "Sapporo",
    "Tunis",
    "Utrecht",
    "Valencia",
    "Windhoek",
]
# filler in the spirit of the essays the original test used: plain, on-topic for nothing
SUBJECTS = [
    "The committee",
    "A farmer",
    "The old library",
    "Our neighbour",
    "The river",
    "A small company",
    "The museum",
    "The orchestra",
    "A traveller",
    "The school",
]
VERBS = [
    "opened",
    "painted",
    "described",
    "repaired",
    "visited",
    "measured",
    "planned",
    "studied",
    "counted",
    "photographed",
]
OBJECTS = [
    "the northern bridge",
    "a wooden boat",
    "the winter garden",
    "an empty warehouse",
    "the harbour wall",
    "a long letter",
    "the village square",
    "a stone tower",
    "the morning market",
    "a quiet street",
]
TIMES = [
    "last spring",
    "after lunch",
    "before the storm",
    "every Tuesday",
    "in the evening",
    "during the festival",
    "at dawn",
    "over the summer",
    "once a year",
    "the day before",
]


class NeedleConfig(StageConfig):
    lengths: list[int] = Field([64, 128, 256], description="context lengths in tokens")
    depths: list[float] = Field([0.0, 0.25, 0.5, 0.75, 1.0])
    trials: int = Field(2, ge=1, description="needles per grid cell")
    mode: str = Field("loglikelihood", pattern="^(generate|loglikelihood)$")
    distractors: int = Field(4, ge=1, description="loglikelihood mode: random codes the true one must beat")
    threshold: float = Field(0.5, gt=0, le=1, description="retrieval rate that counts as working")
    haystack: str | None = Field(
        None, description="a text file (local or s3://) to take the filler from (default: generated)"
    )
    max_tokens: int = Field(12, ge=1)
    seed: int = 0


def filler_sentences(cfg: NeedleConfig, rng: random.Random) -> list[str]:
    if cfg.haystack:
        text = storage.read_bytes(storage.normalize(cfg.haystack)).decode("utf-8")
        sentences = [s.strip() + "." for s in text.replace("\n", " ").split(".") if len(s.strip()) > 3]
        if not sentences:
            raise ValueError(f"needle haystack {cfg.haystack} holds no sentences")
        return sentences
    return [
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TIMES)}." for _ in range(2000)
    ]


def build_haystack(
    model: EvalModel, sentences: list[str], length: int, depth: float, needle: str, question: str, rng: random.Random
) -> str:
    """Filler around the needle, `depth` of the way in, so that filler, needle and question make
    about `length` tokens."""
    budget = length - model.count_tokens(needle) - model.count_tokens(question)
    start = rng.randrange(len(sentences))
    filler, used = [], 0
    while True:
        sentence = sentences[(start + len(filler)) % len(sentences)]
        cost = model.count_tokens(" " + sentence)
        if used + cost > budget:
            break
        filler.append(sentence)
        used += cost
    at = round(depth * len(filler))
    return " ".join(filler[:at] + [needle] + filler[at:])


def run_needle(model: EvalModel, cfg: NeedleConfig) -> dict:
    rng = random.Random(cfg.seed)
    sentences = filler_sentences(cfg, rng)
    cells, prompts, requests = [], [], []
    for length in cfg.lengths:
        for depth in cfg.depths:
            for _ in range(cfg.trials):
                city, code = rng.choice(CITIES), f"{rng.randrange(10000, 100000)}"
                needle = f"The secret code of {city} is {code}."
                if cfg.mode == "generate":
                    question = f"\n\nWhat is the secret code of {city}? Reply with the number only."
                    haystack = build_haystack(model, sentences, length, depth, needle, question, rng)
                    prompts.append([{"role": "user", "content": haystack + question}])
                else:
                    question = f" The secret code of {city} is"
                    haystack = build_haystack(model, sentences, length, depth, needle, question, rng)
                    codes = [code] + [f"{rng.randrange(10000, 100000)}" for _ in range(cfg.distractors)]
                    requests.append([(haystack + question, " " + c) for c in codes])
                cells.append((length, depth, code))
    if cfg.mode == "generate":
        found = [code in reply for reply, (_, _, code) in zip(model.chat(prompts, cfg.max_tokens), cells)]
    else:
        flat = model.loglikelihood([r for group in requests for r in group])
        found, i = [], 0
        for group in requests:
            lls = [ll for ll, _ in flat[i : i + len(group)]]
            found.append(lls[0] > max(lls[1:]))
            i += len(group)
    grid: dict[int, dict[float, list[bool]]] = {}
    for (length, depth, _), hit in zip(cells, found):
        grid.setdefault(length, {}).setdefault(depth, []).append(hit)
    heatmap = [[sum(grid[L][d]) / len(grid[L][d]) for d in cfg.depths] for L in cfg.lengths]
    by_length = {L: sum(row) / len(row) for L, row in zip(cfg.lengths, heatmap)}
    effective = 0
    for L in sorted(cfg.lengths):
        if by_length[L] < cfg.threshold:
            break
        effective = L
    return {
        "mode": cfg.mode,
        "lengths": cfg.lengths,
        "depths": cfg.depths,
        "trials": cfg.trials,
        "heatmap": heatmap,
        "retrieval_by_length": {str(L): r for L, r in by_length.items()},
        "threshold": cfg.threshold,
        "effective_context_length": effective,
        "chance": 1 / (cfg.distractors + 1) if cfg.mode == "loglikelihood" else 0.0,
    }
