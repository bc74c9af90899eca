"""Does a model answer the orders agent's held-out questions? Each held-out question of
`lmfoundry tool-data` goes to the agent service as a run, through its real API (Ray Serve: the
model behind the OpenAI-compatible API, the agents app, the orders workflow on the demo database).
The run's final answer is checked against the database with tool-data's verifier, and its tool
calls are read from the run's steps.

    lmfoundry agents demo-data --out work/agents
    lmfoundry tool-data configs/tool_data.yaml --output work/tool_data
    python benchmarks/agent_sft.py --build-base work/agent_base         # the model to fine-tune
    lmfoundry sft configs/sft_agent_cpu.yaml --input work/agent_base --output work/agent_sft
    python benchmarks/agent_sft.py --checkpoint work/agent_sft          # the fine-tuned model
    python benchmarks/agent_sft.py --untrained --runs 20                # the baseline: random weights

`--build-base` and `--untrained` build a model of the quickstart's size with the 1,024-token context the workflow
needs (configs/quickstart_agent.yaml) and a copyable BPE of 4,096 tokens (on the sample corpus's
1,500 documents and, for the base, the training conversations). `--build-base` teaches it to copy
first (warm_up_copying, about 10 minutes on 2 cores); `--untrained` keeps random weights and
shows what a model that was never trained on tool calls does. Writes
benchmarks/results/agent_sft.json (or agent_sft_untrained.json, or agent_sft_LABEL.json with
`--label LABEL`, for a variant measured beside the recipe's model).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
KEY = "sk-bench-agent-sft-" + "c" * 16
PORT = 8124
MAX_SECONDS = 1800


MIXED_STEPS = 300  # of warm_up_copying's second phase


def warm_up_copying(model, log=print) -> dict:
    """Teach a random-weights model to copy (induction heads, Olsson et al. 2022) before it is
    fine-tuned: a small model fine-tuned from random weights on the tool conversations learns
    their format and the choice of tool but never to copy a value it has not seen from the
    question into the call, or from the tool's result into the answer.

    Two phases on random token sequences (any token of the vocabulary, 16 x 256 tokens a step,
    AdamW at 1e-3), the loss on the tokens that can be copied only:
    - repeats: a random segment of 8-32 tokens repeated to the length. The dense signal makes the
      circuit form, abruptly, after some hundreds of steps; the phase ends when 95% of the
      copyable tokens are predicted (or after 2,000 steps);
    - spans: random text with segments of 4-24 tokens copied 0-59 tokens after themselves, half
      the steps, repeats the other half (MIXED_STEPS): copying from anywhere, not from one period.
    On its own, the spans task did not make the circuit form in 2,500 steps (a run of this
    function without the repeats phase). Returns the steps, the seconds, the repeats accuracy
    every 100 steps (on that step's batch) and the spans accuracy at the end (pooled over 8
    fresh batches)."""
    import torch
    import torch.nn.functional as F

    V, L, B = model.cfg.vocab_size, 256, 16
    gen = torch.Generator().manual_seed(0)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    def repeats():
        period = draw(8, 33)
        x = torch.randint(0, V, (B, period), generator=gen).repeat(1, L // period + 2)[:, : L + 1]
        copyable = torch.zeros(B, L, dtype=torch.bool)
        copyable[:, period:] = True  # from the second copy's second token: its first has no earlier cue
        return x, copyable

    def spans():
        x = torch.randint(0, V, (B, L + 1), generator=gen)
        copyable = torch.zeros(B, L + 1, dtype=torch.bool)
        for row in range(B):
            end = 0
            while True:
                size, source = draw(4, 25), end + draw(0, 20)
                target = source + size + draw(0, 60)
                if target + size > L + 1:
                    break
                x[row, target : target + size] = x[row, source : source + size]
                copyable[row, target + 1 : target + size] = True  # the span's first token is not copyable
                end = target + size
        return x, copyable[:, 1:]

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model.train()

    def step(x, copyable, learn=True):
        with torch.set_grad_enabled(learn):
            logits = model(x[:, :-1])[0][copyable]
            target = x[:, 1:][copyable]
            loss = F.cross_entropy(logits, target)
        if learn:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return int((logits.argmax(-1) == target).sum()), target.numel()

    started, repeat_steps, curve = time.time(), 0, []
    while repeat_steps < 2000:
        repeat_steps += 1
        right, seen = step(*repeats())
        if repeat_steps % 100 == 0:
            curve.append((repeat_steps, round(right / seen, 3)))
            log(f"copy warm-up, repeats: step {repeat_steps}, {right / seen:.0%} of the copyable tokens")
            if right >= 0.95 * seen:
                break
    for mixed in range(MIXED_STEPS):
        step(*(spans() if mixed % 2 else repeats()))
    right, seen = map(sum, zip(*(step(*spans(), learn=False) for _ in range(8))))
    log(f"copy warm-up, spans: {right / seen:.0%} of the copyable tokens after {MIXED_STEPS} mixed steps")
    model.eval()
    return {
        "repeat_steps": repeat_steps,
        "repeats_accuracy_every_100_steps": curve,
        "mixed_steps": MIXED_STEPS,
        "spans_accuracy": round(right / seen, 3),
        "seconds": round(time.time() - started, 1),
    }


def build_small_model(directory: Path, conversations: Path | None = None, warm_up: bool = False) -> None:
    """A model of the quickstart's shape with a 1,024-token context, random weights. Its BPE is
    trained on the quickstart's corpus and, given `conversations` (tool-data's training split),
    on them rendered with the chat template too: the tool-call syntax and the tool definitions
    become a few tokens each (a conversation ~490 tokens instead of ~730 in the corpus-only BPE).
    `warm_up`: taught to copy first (warm_up_copying), the base to fine-tune."""
    import torch

    from lmfoundry.data.sample_corpus import stdlib_documents
    from lmfoundry.data.tokenizer import train_bpe
    from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE, DEFAULT_CHAT_TEMPLATE, ChatTemplate
    from lmfoundry.model.checkpoint import TOKENIZER, save_model_files
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.platform import checkpoint, storage

    torch.manual_seed(0)
    texts = list(stdlib_documents(1500))
    if conversations is not None:
        template = ChatTemplate()
        texts += [template.render(r["messages"], r["tools"]) for r in storage.read_jsonl(str(conversations))]
    tok = train_bpe(texts, vocab_size=4096, copyable=True)
    shape = {"n_layer": 4, "d_model": 128, "n_head": 4, "n_kv_head": 2}  # configs/quickstart_agent.yaml
    model = Transformer(ModelConfig(vocab_size=tok.get_vocab_size(), max_seq_len=1024, **shape)).eval()
    meta = {"step": 0}
    if warm_up:
        meta["copy_warm_up"] = warm_up_copying(model, log=lambda line: print(line, file=sys.stderr, flush=True))
    save_model_files(model, directory)
    (directory / TOKENIZER).write_text(tok.to_str())
    (directory / CHAT_TEMPLATE_FILE).write_text(DEFAULT_CHAT_TEMPLATE)  # what sft renders conversations with
    checkpoint.seal(directory, meta)


def workflow_file(work: Path, agents_data: Path) -> Path:
    """The shipped orders workflow, on the demo data and this benchmark's model endpoint."""
    spec = yaml.safe_load((ROOT / "configs/workflows/orders.yaml").read_text())["workflows"]["orders_and_docs"]
    spec["model_url"], spec["api_key_env"] = f"http://127.0.0.1:{PORT}", "LMFOUNDRY_BENCH_AGENT_SFT_KEY"
    spec["secrets"] = ["LMFOUNDRY_BENCH_AGENT_SFT_KEY"]
    # a run's clock starts when it is queued, and every question is queued at once: the shipped
    # 120 s would time out runs that waited for a free worker slot rather than ran slowly
    spec["max_seconds"] = MAX_SECONDS
    spec["tools"]["sql"]["dsn"] = str(agents_data / "orders.sqlite")
    spec["tools"]["docs"]["corpus"] = str(agents_data / "docs.jsonl")
    path = work / "workflows.yaml"
    # in the shipped order: the tools are offered in it, and a small model trained on that order is
    # thrown by another (yaml sorts keys by default)
    path.write_text(yaml.safe_dump({"workflows": {"orders_and_docs": spec}}, sort_keys=False))
    return path


def start_service(checkpoint: str, workflows: Path, store: Path) -> str:
    from ray import serve

    from lmfoundry.agents.api import AgentServeConfig, build_agent_app
    from lmfoundry.platform.keys import digest
    from lmfoundry.platform.ray_env import init_ray
    from lmfoundry.serving.app import ServeConfig, build_app

    os.environ["LMFOUNDRY_BENCH_AGENT_SFT_KEY"] = KEY
    init_ray()
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    model = ServeConfig(checkpoint=checkpoint, model_name="lmfoundry", cpus_per_replica=1)
    serve.run(build_app(model, [digest(KEY)]), name="llm", route_prefix="/", blocking=False)
    agents = AgentServeConfig(
        workflows=str(workflows),
        store=str(store),
        workers=1,
        runs_per_worker=16,
        per_tenant_running=16,
        per_tenant_active=1000,
        env_from_driver=["LMFOUNDRY_BENCH_AGENT_SFT_KEY"],
    )
    serve.run(build_agent_app(agents, [digest(KEY)]), name="agents", route_prefix="/agents", blocking=False)
    url = f"http://127.0.0.1:{PORT}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if all(httpx.get(f"{url}{p}/health").status_code == 200 for p in ("", "/agents")):
                return f"{url}/agents"
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the model and agents apps did not become healthy within 600 s")


def run_questions(url: str, questions: list[dict], timeout_s: float) -> list[dict]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
        ids = []
        for q in questions:
            response = http.post("/v1/agents/runs", json={"workflow": "orders_and_docs", "input": q["question"]})
            response.raise_for_status()
            ids.append(response.json()["id"])
        runs: dict[str, dict] = {}
        deadline = time.time() + timeout_s
        while len(runs) < len(ids) and time.time() < deadline:
            for run_id in ids:
                if run_id not in runs:
                    run = http.get(f"/v1/agents/runs/{run_id}").json()
                    if run["state"] in ("succeeded", "failed", "cancelled"):
                        runs[run_id] = run
            time.sleep(0.5)
    return [runs.get(run_id, {"id": run_id, "state": "timed out", "steps": []}) for run_id in ids]


def judge(question: dict, run: dict, ref) -> dict:
    from lmfoundry.agents.tool_data import verify_answer

    answer = run.get("output") or ""
    verdict = verify_answer(question["intent"], question["values"], answer, ref) if answer else "no answer"
    model_steps = [s for s in run["steps"] if s["kind"] == "model"]
    return {
        "question": question["question"],
        "intent": question["intent"],
        "state": run["state"],
        "error": run.get("error"),
        "answer": answer,
        "correct": verdict is None,
        "why_not": verdict,
        "tool_calls": [
            {"tool": s["tool"], "arguments": s["arguments"], "ok": s.get("ok")}
            for s in run["steps"]
            if s["kind"] == "tool" and s.get("status") == "done"
        ],
        "model_steps": len(model_steps),
        "invalid_replies": sum(s["tool"] == "_invalid_reply" for s in model_steps),
    }


def teacher_forced(checkpoint: str, conversations: Path, questions: list[dict]) -> dict:
    """Where the model's next-token guesses go wrong on the held-out conversations, each guess
    given every earlier token (no serving, no sampling), the assistant's tokens grouped by what
    they need: `choice`, the tool's name and the query's kind (after `"name": "`, and from
    `SELECT ` to ` FROM`), which the question's words decide; `copied value`, a token of the
    question's customer or item where the reply writes it; `digit`, a digit (of the question's
    order, or of a tool result's number); `other`, the rest (the JSON, the SQL's frame, the
    answer's template, words a tool result gives). The copied values' tokens are also counted
    piece by piece, right or wrong, for each value."""
    import torch

    from lmfoundry.model.checkpoint import load_model_files
    from lmfoundry.platform import checkpoint as checkpoints
    from lmfoundry.train.sft_data import ConversationEncoder, read_conversations

    model_dir = checkpoints.local_copy(checkpoints.resolve(checkpoint), model_only=True)  # a run: its final model
    model = load_model_files(model_dir).eval()
    encoder = ConversationEncoder(model_dir, model.cfg.max_seq_len + 1)
    tokenizer = encoder.tokenizer
    right, seen, exact = Counter(), Counter(), 0
    pieces: dict[str, Counter] = {}  # value -> (piece, right or wrong) -> tokens
    for (_, conversation), question in zip(read_conversations(str(conversations)), questions, strict=True):
        encoded = encoder.encode(conversation)
        ids = encoded.ids
        in_value = {}  # position of a token of an occurrence of a value -> the value
        for key in ("customer", "item"):
            if key in question["values"]:
                name = str(question["values"][key])
                value = tokenizer.encode(name, add_special_tokens=False).ids
                for at in range(len(ids) - len(value) + 1):
                    if ids[at : at + len(value)] == value:
                        in_value.update(dict.fromkeys(range(at, at + len(value)), name))
        with torch.no_grad():
            guesses = model(torch.tensor([ids[:-1]]))[0].argmax(-1)[0].tolist()
        whole = True
        for at, (guess, target) in enumerate(zip(guesses, ids[1:])):
            if not encoded.assistant[at + 1]:
                continue
            before = tokenizer.decode(ids[max(0, at - 15) : at + 1], skip_special_tokens=False)
            select = before.rfind("SELECT ")
            if before.endswith('"name": "') or (select >= 0 and " FROM" not in before[select:]):
                kind = "choice"
            elif at + 1 in in_value:
                kind = "copied value"
                piece = (tokenizer.id_to_token(target), "right" if guess == target else "wrong")
                pieces.setdefault(in_value[at + 1], Counter())[piece] += 1
            elif tokenizer.id_to_token(target).isdigit():
                kind = "digit"
            else:
                kind = "other"
            seen[kind] += 1
            right[kind] += guess == target
            whole &= guess == target
        exact += whole
    return {
        "accuracy": {k: round(right[k] / seen[k], 3) for k in sorted(seen)},
        "tokens": dict(sorted(seen.items())),
        "copied value by piece": {
            value: {f"{piece} {verdict}": n for (piece, verdict), n in sorted(counts.items())}
            for value, counts in sorted(pieces.items())
        },
        "conversations_exact": exact,
        "conversations": len(questions),
    }


def unseen_rows(checkpoint: str, trained: dict) -> dict | None:
    """How alike the output head's rows of the tokens the training conversations never hold have
    become: their mean pairwise cosine in the fine-tuned model and in its base (after the base's
    copy warm-up, which draws every token, about 0). When the head trains, every step's softmax
    pushes all of those rows away from the hidden state, the same way."""
    import torch

    from lmfoundry.model.checkpoint import load_model_files
    from lmfoundry.platform import checkpoint as checkpoints
    from lmfoundry.train.sft_data import ConversationEncoder, read_conversations

    if not trained.get("start_checkpoint") or not trained.get("data"):
        return None
    model_dir = checkpoints.local_copy(checkpoints.resolve(checkpoint), model_only=True)
    base_dir = checkpoints.local_copy(checkpoints.resolve(trained["start_checkpoint"]), model_only=True)
    encoder = ConversationEncoder(model_dir, 1 << 20)
    seen = set()
    for _, conversation in read_conversations(trained["data"]):
        seen.update(encoder.encode(conversation).ids)

    def mean_cosine(directory) -> tuple[int, float]:
        rows = load_model_files(directory).lm_head.weight.detach().float()
        unseen = torch.tensor([i for i in range(rows.shape[0]) if i not in seen], dtype=torch.long)
        unit = torch.nn.functional.normalize(rows[unseen], dim=-1)
        n = len(unseen)
        return n, round(((unit.sum(0).square().sum() - n) / (n * n - n)).item(), 3) if n > 1 else None

    n, tuned = mean_cosine(model_dir)
    return {"tokens": n, "fine_tuned": tuned, "base": mean_cosine(base_dir)[1]}


def training(run: str) -> dict | None:
    """What the fine-tuned model's SFT run recorded: steps, time, losses, its data, its base's
    copy warm-up."""
    from lmfoundry.platform import checkpoint, storage

    if not storage.is_committed(run):
        return None
    m = storage.read_manifest(run)
    keep = (
        "start_checkpoint",
        "data",
        "steps",
        "seconds",
        "first_loss",
        "final_loss",
        "assistant_loss",
        "lora",
        "freeze",
        "untie_embeddings",
        "seed",
    )
    base = m.get("start_checkpoint")
    manifest = Path(base) / checkpoint.CHECKPOINT_MANIFEST if base else None
    # --build-base's record of the copy warm-up
    warm_up = json.loads(manifest.read_text()).get("copy_warm_up") if manifest and manifest.is_file() else None
    return {
        **{k: m[k] for k in keep if k in m},
        "conversations": m.get("data_report", {}).get("conversations"),
        "base_copy_warm_up": warm_up,
    }


def label(text: str) -> str:
    if not re.fullmatch(r"[a-z0-9_]{1,40}", text) or text == "untrained":
        raise argparse.ArgumentTypeError(f"{text!r}: a label is 1 to 40 of a-z, 0-9 and _, not 'untrained'")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="the model to serve (a fine-tuned checkpoint)")
    ap.add_argument("--untrained", action="store_true", help="a random-weights model of the quickstart's size")
    ap.add_argument(
        "--build-base", metavar="DIR", help="only write that model, taught to copy, to DIR (the base to fine-tune)"
    )
    ap.add_argument("--data", default="work/tool_data", help="a tool-data output (its held-out questions)")
    ap.add_argument("--agents-data", default="work/agents", help="the demo database and corpus tool-data used")
    ap.add_argument("--runs", type=int, default=0, help="at most this many held-out questions (0: all)")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument(
        "--label", type=label, help="write agent_sft_LABEL.json: a variant measured beside the recipe's model"
    )
    args = ap.parse_args()
    if args.build_base:
        build_small_model(Path(args.build_base), Path(args.data) / "train.jsonl", warm_up=True)
        print(f"wrote {args.build_base}", file=sys.stderr)
        return
    if bool(args.checkpoint) == args.untrained:
        ap.error("give --checkpoint or --untrained")
    if args.label and args.untrained:
        ap.error("--label names a fine-tuned variant; --untrained writes agent_sft_untrained.json")
    from lmfoundry.agents.tool_data import Reference
    from lmfoundry.agents.workflow import load_workflows
    from lmfoundry.platform import storage

    every_question = [q for q in storage.read_jsonl(str(Path(args.data) / "questions.jsonl")) if q["split"] == "test"]
    questions = every_question[: args.runs] if args.runs else every_question  # tool-data wrote them round-robin
    work = Path(tempfile.mkdtemp(prefix="lmfoundry-bench-agent-sft-"))
    checkpoint = args.checkpoint
    if args.untrained:
        checkpoint = str(work / "untrained")
        build_small_model(Path(checkpoint))
    workflows = workflow_file(work, Path(args.agents_data).resolve())
    ref = Reference.read(load_workflows(str(workflows))["orders_and_docs"])
    url = start_service(checkpoint, workflows, work / "runs.sqlite")
    started = time.time()
    runs = run_questions(url, questions, args.timeout_s)
    wall = time.time() - started
    judged = [judge(q, r, ref) for q, r in zip(questions, runs)]

    by_intent = {}
    for intent in sorted({j["intent"] for j in judged}):
        mine = [j for j in judged if j["intent"] == intent]
        by_intent[intent] = {"runs": len(mine), "correct": sum(j["correct"] for j in mine)}
    trained = training(checkpoint) if not args.untrained else None
    result = {
        "benchmark": "agent_sft",
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(["benchmarks/agent_sft.py", *sys.argv[1:]]),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "model": "untrained: random weights, 4 layers, d_model 128, 1,024 context" if args.untrained else checkpoint,
        "training": trained,
        "workflow_max_seconds": MAX_SECONDS,
        "held_out_questions": len(questions),
        "correct": sum(j["correct"] for j in judged),
        "correct_share": round(sum(j["correct"] for j in judged) / max(1, len(judged)), 3),
        "states": dict(sorted(Counter(j["state"] for j in judged).items())),
        "run_errors": dict(Counter((j["error"] or "none")[:160] for j in judged).most_common(5)),
        "by_intent": by_intent,
        "runs_with_a_tool_call": sum(bool(j["tool_calls"]) for j in judged),
        "median_model_steps": statistics.median(j["model_steps"] for j in judged) if judged else 0,
        "model_steps": sum(j["model_steps"] for j in judged),
        "invalid_replies": sum(j["invalid_replies"] for j in judged),
        "wall_s": round(wall, 1),
        "teacher_forced": teacher_forced(checkpoint, Path(args.data) / "test.jsonl", every_question),
        "unseen_tokens_head_rows_mean_cosine": unseen_rows(checkpoint, trained) if trained else None,
        "examples": judged[:3],
        "wrong (the first 20)": [
            {k: j[k] for k in ("question", "answer", "tool_calls")} for j in judged if not j["correct"]
        ][:20],
    }
    # paths inside the repository as the README's commands give them, not this machine's
    result = json.loads(json.dumps(result, default=str).replace(f"{ROOT}/", ""))
    name = "agent_sft_untrained.json" if args.untrained else f"agent_sft{'_' + args.label if args.label else ''}.json"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / name).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{'measure':<28}{'value':>10}")
    for key in ("held_out_questions", "correct", "correct_share", "runs_with_a_tool_call", "model_steps"):
        print(f"{key:<28}{result[key]:>10}")
    print(f"{'invalid_replies':<28}{result['invalid_replies']:>10}")
    print(f"states: {result['states']}")
    forced = result["teacher_forced"]
    print(
        f"teacher-forced, every held-out conversation: {forced['conversations_exact']} of {forced['conversations']} exact"
    )
    for kind, accuracy in forced["accuracy"].items():
        print(f"  {kind:<26}{accuracy:>10.3f}  of {forced['tokens'][kind]} tokens")
    rows = result["unseen_tokens_head_rows_mean_cosine"]
    if rows:
        print(
            f"head rows of the {rows['tokens']} tokens training never holds, mean pairwise cosine: "
            f"{rows['fine_tuned']} (base {rows['base']})"
        )
    print(f"wrote {RESULTS / name}", file=sys.stderr)
    from ray import serve

    serve.shutdown()


if __name__ == "__main__":
    main()
