"""Preference pairs judged by a teacher, with human review and audit.

    lmfoundry pairs configs/pairs.yaml --output work/pairs

A Ray Data pipeline: prompts -> held-out exclusion -> `candidates` sampled replies per prompt from
the student -> every reply scored by the teacher on the three rubric dimensions, `judgments`
times with different seeds -> best and worst by the mean of the dimensions -> the pair compared
by the teacher both ways round (position-swapped). Then each prompt is routed:

- `tie`: best and worst score the same: never emitted as a pair (chosen == rejected teaches
  nothing and is a known failure of popular tools); kept in `rejected.jsonl` with the reason;
- `review`, "judges disagree": some judgment, or one of the two swapped comparisons, prefers the
  worst; "low confidence": the margin is under `min_margin`; the pair goes to the review queue;
- accepted into `pairs.jsonl`; of those, `audit_rate` (by a hash of the pair's id, so the sample
  does not change between reruns) also go to the queue for a human audit.

Confidence = (margin / 9) x agreement, where agreement is the share of the repeated judgments
and swapped comparisons that prefer the chosen reply. Prompts that are, or nearly are (word
3-gram Jaccard), prompts of the evaluation suites are excluded first, so the model never trains
on what judges it. `finalize` folds the reviewers' decisions back in, with provenance.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
import time
import unicodedata
from importlib import resources
from pathlib import Path

from pydantic import Field, model_validator

from lmfoundry.align.judge import DIMENSIONS, JudgeError
from lmfoundry.align.review import ReviewStore
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


class ModelRef(StageConfig):
    """A model by checkpoint (run in the Ray Data actor) or by OpenAI-compatible endpoint."""

    checkpoint: str | None = None
    url: str | None = None
    model: str | None = None
    api_key_env: str | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.checkpoint is None) == (self.url is None):
            raise ValueError("set exactly one of checkpoint and url (with model)")
        if self.url is not None and not self.model:
            raise ValueError("an endpoint needs model (the name it serves)")
        return self

    def api_key(self) -> str | None:
        import os

        return os.environ.get(self.api_key_env) if self.api_key_env else None


class PairsConfig(StageConfig):
    prompts: str = Field(..., description="JSONL with 'prompt' (text or chat messages) and optionally 'id'")
    output: str
    student: ModelRef
    judge: ModelRef
    candidates: int = Field(4, ge=2, le=16)
    temperature: float = Field(1.0, gt=0, le=2)
    max_tokens: int = Field(64, ge=1)
    judgments: int = Field(2, ge=1, description="scorings of every reply, each with its own seed")
    min_margin: float = Field(1.0, ge=0, le=9, description="best - worst mean score below this goes to review")
    audit_rate: float = Field(0.03, ge=0, le=1)
    held_out: list[str] = Field(
        ["builtin"], description="JSONL files or folders of prompts never to train on; builtin: the evaluation suites"
    )
    near_duplicate_jaccard: float = Field(0.6, gt=0, le=1)
    review_db: str | None = Field(None, description="the queue's DSN (default: OUTPUT/review.sqlite)")
    concurrency: int = Field(1, ge=1, description="Ray Data actors for the student and for the judge")
    seed: int = 0
    overwrite: bool = False


# --- held-out protection -----------------------------------------------------------------------

TEXT_FIELDS = ("prompt", "question", "context", "text", "input")


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.sub(r"[^\w\s]", " ", text).split())


def shingles(text: str, n: int = 3) -> set[str]:
    words = normalise(text).split()
    return {" ".join(words[i : i + n]) for i in range(max(len(words) - n + 1, 1))}


def prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m.get("content") or "" for m in prompt if m.get("role") == "user")


class HeldOut:
    """The evaluation prompts: an exact match after normalisation (by hash) or a near duplicate
    (word 3-gram Jaccard at or above the threshold) is excluded."""

    def __init__(self, sources: list[str], threshold: float):
        self.hashes: set[str] = set()
        self.sets: list[set[str]] = []
        self.index: dict[str, list[int]] = {}
        self.threshold = threshold
        for text in self._texts(sources):
            self.hashes.add(hashlib.sha256(normalise(text).encode()).hexdigest())
            grams = shingles(text)
            for g in grams:
                self.index.setdefault(g, []).append(len(self.sets))
            self.sets.append(grams)

    @staticmethod
    def _texts(sources: list[str]):
        for source in sources:
            root = Path(str(resources.files("lmfoundry.eval") / "suites")) if source == "builtin" else Path(source)
            files = sorted(root.rglob("*.jsonl")) if root.is_dir() else [root]
            for f in files:
                for line in f.read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        row = json.loads(line)
                        yield from (str(row[k]) for k in TEXT_FIELDS if isinstance(row.get(k), str))

    def match(self, text: str) -> str | None:
        """Why the text is held out ("exact" or "near duplicate"), or None."""
        if hashlib.sha256(normalise(text).encode()).hexdigest() in self.hashes:
            return "exact"
        grams = shingles(text)
        for i in {i for g in grams for i in self.index.get(g, ())}:
            other = self.sets[i]
            if len(grams & other) / len(grams | other) >= self.threshold:
                return "near duplicate"
        return None


# --- routing -----------------------------------------------------------------------------------


def overall(scores: dict[str, float]) -> float:
    return sum(scores[d] for d in DIMENSIONS) / len(DIMENSIONS)


def best_and_worst(cands: list[dict]) -> tuple[list[float], int, int]:
    """Each candidate's mean overall score over its judgments, and the best and worst by it."""
    means = [statistics.fmean(overall(s) for s in c["scores"]) for c in cands]
    return means, max(range(len(cands)), key=means.__getitem__), min(range(len(cands)), key=means.__getitem__)


def route(record: dict, cfg: PairsConfig) -> dict:
    """From a judged record ({"id", "prompt", "candidates": [{"text", "scores": [per judgment]}],
    "swapped": [verdict with best first, verdict with worst first]} or an "error"), the decision:
    {"route": accept | review | tie | error, "reason", "pair"?, "confidence"?}."""
    if record.get("error"):
        return {"route": "review", "reason": f"judge failed: {record['error']}"}
    cands = record["candidates"]
    means, best, worst = best_and_worst(cands)
    margin = means[best] - means[worst]
    if margin <= 1e-9:
        return {"route": "tie", "reason": "every reply scored the same: a tie is never a pair"}
    votes = [overall(a) > overall(b) for a, b in zip(cands[best]["scores"], cands[worst]["scores"])]
    first, second = record["swapped"]  # (best, worst) shown in that order, then the other way round
    votes += [first == "first", second == "second"]
    agreement = sum(votes) / len(votes)
    per_dimension = {
        d: statistics.fmean(s[d] for s in cands[best]["scores"])
        - statistics.fmean(s[d] for s in cands[worst]["scores"])
        for d in DIMENSIONS
    }
    pair = {
        "id": record["id"],
        "prompt": record["prompt"],
        "chosen": cands[best]["text"],
        "rejected": cands[worst]["text"],
        "margin": margin,
        "agreement": agreement,
        "confidence": margin / 9.0 * agreement,
        "score_margin_by_dimension": per_dimension,
        "chosen_scores": cands[best]["scores"],
        "rejected_scores": cands[worst]["scores"],
        "judge": record["judge"],
        "student": record["student"],
    }
    if cands[best]["text"] == cands[worst]["text"]:
        return {"route": "tie", "reason": "the best and worst replies are the same text"}
    if agreement < 1.0:
        return {"route": "review", "reason": "judges disagree", "pair": pair}
    if margin < cfg.min_margin:
        return {"route": "review", "reason": "low confidence", "pair": pair}
    return {"route": "accept", "reason": "", "pair": pair}


def audited(pair_id: str, rate: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{pair_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < rate


# --- the Ray Data stages -------------------------------------------------------------------------


def open_model(ref: ModelRef):
    """The student (or a solver) as an evaluation model: generation by checkpoint or endpoint."""
    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.clients.openai import EndpointModel
    from lmfoundry.platform import checkpoint

    if not ref.checkpoint:
        return EndpointModel(ref.url, ref.model, ref.api_key())
    with checkpoint.opened(ref.checkpoint) as (local, _):
        return CheckpointModel(local)  # loaded whole into memory: a temporary copy can go


def open_judge(ref: ModelRef):
    from lmfoundry.align.judge import CheckpointJudge, EndpointJudge
    from lmfoundry.platform import checkpoint

    if not ref.checkpoint:
        return EndpointJudge(ref.url, ref.model, ref.api_key())
    with checkpoint.opened(ref.checkpoint) as (local, _):
        return CheckpointJudge(local)  # loaded whole into memory: a temporary copy can go


class SampleCandidates:
    """Ray Data actor: `candidates` sampled replies per prompt (seeds fixed by the run's seed)."""

    def __init__(self, cfg_json: dict):
        self.cfg = PairsConfig.model_validate(cfg_json)
        self.model = open_model(self.cfg.student)

    def __call__(self, row: dict) -> dict:
        prompt = json.loads(row["prompt"])  # JSON text in the dataset: a prompt is text or a list of messages
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        base = int(hashlib.sha256(f"{self.cfg.seed}:{row['id']}".encode()).hexdigest()[:8], 16)
        # one call for all candidates (seeds base .. base + N - 1): an endpoint gets them concurrently and batches them
        texts = self.model.sample([messages] * self.cfg.candidates, self.cfg.max_tokens, self.cfg.temperature, base)
        return {**row, "replies": json.dumps(texts), "student": self.model.name}


def judge_record(judge, row: dict, judgments: int, seed: int) -> dict:
    """Score every reply `judgments` times, then compare best and worst both ways round."""
    prompt = prompt_text(row["prompt"])
    texts = list(dict.fromkeys(json.loads(row["replies"])))  # identical replies are one candidate
    out = {"id": row["id"], "prompt": row["prompt"], "judge": judge.name, "student": row["student"]}
    try:
        cands = [{"text": t, "scores": [judge.score(prompt, t, seed + j) for j in range(judgments)]} for t in texts]
        if len(cands) < 2:
            return {**out, "candidates": cands, "swapped": ["tie", "tie"]}
        _, best, worst = best_and_worst(cands)
        swapped = [
            judge.prefer(prompt, cands[best]["text"], cands[worst]["text"], seed),
            judge.prefer(prompt, cands[worst]["text"], cands[best]["text"], seed + 1),
        ]
    except JudgeError as e:
        return {**out, "error": str(e)}
    return {**out, "candidates": cands, "swapped": swapped}


class JudgeCandidates:
    def __init__(self, cfg_json: dict):
        self.cfg = PairsConfig.model_validate(cfg_json)
        self.judge = open_judge(self.cfg.judge)

    def __call__(self, row: dict) -> dict:
        row = {**row, "prompt": json.loads(row["prompt"])}
        return {"record": json.dumps(judge_record(self.judge, row, self.cfg.judgments, self.cfg.seed))}


# --- the stage ---------------------------------------------------------------------------------


def read_prompts(uri: str) -> list[dict]:
    rows = []
    for n, row in enumerate(storage.read_jsonl(uri)):
        if "prompt" not in row:
            raise ValueError(f"{uri}: record {n} needs 'prompt'")
        row.setdefault("id", hashlib.sha256(json.dumps(row["prompt"]).encode()).hexdigest()[:16])
        rows.append({"id": str(row["id"]), "prompt": row["prompt"]})
    if not rows:
        raise ValueError(f"{uri} holds no prompts")
    return rows


def chat_form(pair: dict) -> dict:
    messages = pair["prompt"] if isinstance(pair["prompt"], list) else [{"role": "user", "content": pair["prompt"]}]
    return {
        "id": pair["id"],
        "prompt": messages,
        "chosen": [{"role": "assistant", "content": pair["chosen"]}],
        "rejected": [{"role": "assistant", "content": pair["rejected"]}],
    }


def run_pairs(cfg: PairsConfig) -> dict:
    import ray

    out = storage.normalize(cfg.output)
    if not storage.prepare_output(out, cfg.overwrite):
        logger.info("pairs: %s is already committed; skipping (set overwrite=true to redo)", out)
        return storage.read_json(storage.join(out, "card.json"))
    started = time.time()
    prompts = read_prompts(cfg.prompts)
    held_out = HeldOut(cfg.held_out, cfg.near_duplicate_jaccard)
    rejected, kept = [], []
    for row in prompts:
        why = held_out.match(prompt_text(row["prompt"]))
        if why:
            rejected.append({**row, "reason": f"held out: {why} of an evaluation prompt"})
        else:
            kept.append(row)
    cfg_json = cfg.model_dump(mode="json")
    records = []
    if kept:
        ds = ray.data.from_items([{"id": r["id"], "prompt": json.dumps(r["prompt"])} for r in kept])
        ds = ds.map(SampleCandidates, fn_constructor_args=(cfg_json,), concurrency=cfg.concurrency)
        ds = ds.map(JudgeCandidates, fn_constructor_args=(cfg_json,), concurrency=cfg.concurrency)
        records = sorted((json.loads(r["record"]) for r in ds.iter_rows()), key=lambda r: r["id"])
    store = ReviewStore(cfg.review_db or storage.join(out, "review.sqlite"))
    accepted, queued, audits = [], 0, 0
    for record in records:
        decision = route(record, cfg)
        if decision["route"] == "tie":
            rejected.append({"id": record["id"], "prompt": record["prompt"], "reason": decision["reason"]})
        elif decision["route"] == "review":
            payload = decision.get("pair") or {"id": record["id"], "prompt": record["prompt"], "judge": record["judge"]}
            queued += store.add(f"review-{record['id']}", "review", decision["reason"], payload)
        else:
            accepted.append(decision["pair"])
            if audited(record["id"], cfg.audit_rate, cfg.seed):
                audits += store.add(f"audit-{record['id']}", "audit", "random audit", decision["pair"])
    store.close()
    storage.write_jsonl_atomic(storage.join(out, "pairs.jsonl"), accepted)
    storage.write_jsonl_atomic(storage.join(out, "pairs_chat.jsonl"), [chat_form(p) for p in accepted])
    storage.write_jsonl_atomic(storage.join(out, "rejected.jsonl"), rejected)
    reasons: dict[str, int] = {}
    for r in rejected:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    confidences = [p["confidence"] for p in accepted]
    card = {
        "prompts": len(prompts),
        "accepted": len(accepted),
        "queued_for_review": queued,
        "queued_for_audit": audits,
        "rejected_by_reason": reasons,
        "judge": records[0]["judge"] if records else None,
        "student": records[0]["student"] if records else None,
        "candidates": cfg.candidates,
        "judgments": cfg.judgments,
        "min_margin": cfg.min_margin,
        "audit_rate": cfg.audit_rate,
        "confidence": {"min": min(confidences), "median": statistics.median(confidences), "max": max(confidences)}
        if confidences
        else None,
        "review_db": cfg.review_db or storage.join(out, "review.sqlite"),
        "seconds": round(time.time() - started, 2),
    }
    storage.write_json_atomic(storage.join(out, "card.json"), card)
    storage.write_bytes_atomic(storage.join(out, "CARD.md"), card_markdown(card).encode())
    fingerprint = storage.fingerprint(out, ["pairs.jsonl", "pairs_chat.jsonl", "rejected.jsonl"])
    storage.commit(out, "pairs", {"card": "card.json", "pairs": "pairs.jsonl", "fingerprint": fingerprint})
    logger.info(
        "pairs: %d prompts -> %d pairs accepted, %d to review, %d to audit, rejected %s",
        len(prompts),
        len(accepted),
        queued,
        audits,
        reasons,
    )
    return card


def card_markdown(card: dict) -> str:
    """The dataset card for people: what went in, what came out, how sure the judges were."""
    lines = [
        "# Preference pairs",
        "",
        f"- prompts: {card['prompts']}; accepted pairs: {card['accepted']}; sent to review: "
        f"{card['queued_for_review']}; sampled for audit: {card['queued_for_audit']}",
        f"- student: {card['student']}; judge: {card['judge']}; {card['candidates']} candidates a prompt, "
        f"{card['judgments']} judgments a reply, min margin {card['min_margin']}, audit rate {card['audit_rate']}",
        "- rejected: " + (", ".join(f"{n} {r}" for r, n in card["rejected_by_reason"].items()) or "none"),
    ]
    if card.get("confidence"):
        c = card["confidence"]
        lines.append(
            f"- confidence of accepted pairs: min {c['min']:.3f}, median {c['median']:.3f}, max {c['max']:.3f}"
        )
    if card.get("final"):
        f = card["final"]
        lines += [
            "",
            "## After review",
            "",
            f"- final pairs: {f['pairs']} ({f['from_judge']} as judged, {f['from_review']} from human review)",
            f"- review decisions: {f['review_decisions']}; audits decided: {f['audits_decided']}",
            f"- audit disagreement by dimension: {f['audit_disagreement_by_dimension']}",
            f"- audit disagreement by judge: {f['audit_disagreement_by_judge']}",
        ]
    return "\n".join(lines) + "\n"


def finalize(output: str, review_db: str | None = None) -> dict:
    """Fold the reviewers' decisions into `final/pairs.jsonl` (and its chat form): decided review
    items join (as the judge ordered them, or swapped), audited pairs a reviewer disagreed with
    leave; every pair says where it came from. The card gains the review and audit outcomes,
    with audit disagreement rates per rubric dimension and per judge."""
    out = storage.normalize(output)
    store = ReviewStore(review_db or storage.join(out, "review.sqlite"))
    items = {i["id"]: i for i in store.list()}
    store.close()
    pairs = storage.read_jsonl(storage.join(out, "pairs.jsonl"))
    final = []
    for pair in pairs:
        audit = items.get(f"audit-{pair['id']}")
        if audit and audit["status"] == "decided":
            pair = {
                **pair,
                "audit": {
                    "decision": audit["decision"],
                    "reviewer": audit["decided_by"],
                    "dimensions": audit["dimensions"],
                },
            }
            if audit["decision"] == "disagree":
                continue
        final.append({**pair, "source": "judge"})
    reviewed = {"a": 0, "b": 0, "reject": 0, "pending": 0}
    for item in items.values():
        if item["kind"] != "review":
            continue
        if item["status"] != "decided":
            reviewed["pending"] += 1
            continue
        reviewed[item["decision"]] += 1
        pair = item["payload"]
        if item["decision"] == "reject" or "chosen" not in pair:
            continue
        if item["decision"] == "b":
            pair = {**pair, "chosen": pair["rejected"], "rejected": pair["chosen"]}
        final.append(
            {**pair, "source": "human review", "reviewer": item["decided_by"], "review_reason": item["reason"]}
        )
    audits = [i for i in items.values() if i["kind"] == "audit" and i["status"] == "decided"]
    by_dimension = {d: [i["dimensions"][d] == "disagree" for i in audits if d in i["dimensions"]] for d in DIMENSIONS}
    by_judge: dict[str, list[bool]] = {}
    for i in audits:
        by_judge.setdefault(i["payload"]["judge"], []).append(i["decision"] == "disagree")
    card = storage.read_json(storage.join(out, "card.json"))
    card["final"] = {
        "pairs": len(final),
        "from_judge": sum(p["source"] == "judge" for p in final),
        "from_review": sum(p["source"] == "human review" for p in final),
        "review_decisions": reviewed,
        "audits_decided": len(audits),
        "audit_disagreement_by_dimension": {d: (sum(v) / len(v) if v else None) for d, v in by_dimension.items()},
        "audit_disagreement_by_judge": {j: sum(v) / len(v) for j, v in by_judge.items()},
    }
    storage.write_bytes_atomic(storage.join(out, "CARD.md"), card_markdown(card).encode())
    storage.write_jsonl_atomic(storage.join(out, "final", "pairs.jsonl"), final)
    storage.write_jsonl_atomic(storage.join(out, "final", "pairs_chat.jsonl"), [chat_form(p) for p in final])
    storage.write_json_atomic(storage.join(out, "card.json"), card)
    return card
