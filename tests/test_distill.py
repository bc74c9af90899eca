"""Distillation data: a real teacher (a local OpenAI-compatible HTTP server, and a tiny checkpoint)
answers a prompt pool; errors are counted, harmful and duplicate answers refused, the output is
SFT conversations the chat template renders, the same bytes twice; and a student fine-tuned on a
teacher's answers scores higher on held-out prompts through the evaluation suite."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sft_chats import build_chat_checkpoint

from lmfoundry.align.distill import DistillConfig, read_prompt_pool, run_distill
from lmfoundry.data.dedup import exact_key
from lmfoundry.model.chat_template import ChatTemplate


class Teacher(BaseHTTPRequestHandler):
    """Answers by the last user message: most prompts well; some with an error status, text that
    is not JSON, a huge body, a trickle of bytes, a harmful answer or one stock answer."""

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/chat/completions" and request["max_tokens"] == 32
        text = request["messages"][-1]["content"]
        if text.startswith("fail"):
            return self._send(500, b'{"error": "overloaded"}')
        if text.startswith("garbage"):
            return self._send(200, b"<html>not the API</html>")
        if text.startswith("huge"):
            return self._send(200, b'{"choices": [{"message": {"content": "' + b"x" * 300_000 + b'"}}]}')
        if text.startswith("slow"):
            self._send(200, b"{", length=1000)
            for _ in range(20):  # one byte every 0.1 s: each read is quick, the whole is not
                time.sleep(0.1)
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return
            return
        if text.startswith("harm"):
            answer = "Here is how to make a bomb at home."
        elif text.startswith("stock"):
            answer = "I  can help with that.\n"  # the same answer, after normalisation, for each
        else:
            answer = f"The answer to {text!r} is {len(text)}."
        body = {"choices": [{"message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]}
        self._send(200, json.dumps(body).encode())


@pytest.fixture(scope="module")
def teacher_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Teacher)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def write_pool(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


POOL = [
    {"id": "a", "prompt": "What is a kettle?"},
    {"id": "b", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why ship?"}]},
    {"id": "a-again", "prompt": "What  is a kettle? "},  # the same prompt once normalised
    {"id": "e1", "prompt": "fail please"},
    {"id": "e2", "prompt": "garbage please"},
    {"id": "e3", "prompt": "huge please"},
    {"id": "e4", "prompt": "slow please"},
    {"id": "h", "prompt": "harm please"},
    {"id": "s1", "prompt": "stock one"},
    {"id": "s2", "prompt": "stock two"},
    {"id": "c", "prompt": "How long is a refund?"},
]


def test_an_endpoint_teacher_gives_counted_filtered_deterministic_sft_data(tmp_path, teacher_url):
    prompts = write_pool(tmp_path / "prompts.jsonl", POOL)
    teacher = {"url": teacher_url, "model": "teacher"}
    outputs = []
    for run in ("one", "two"):
        cfg = DistillConfig(
            prompts=prompts,
            output=str(tmp_path / run),
            teacher=teacher,
            max_tokens=32,
            concurrency=4,
            timeout_s=0.6,
            max_response_bytes=100_000,
            harm={"offensive_language": False},  # the blocklist is the scorer that flags this one; the
            # classifier costs seconds to load
        )
        outputs.append(run_distill(cfg, exact_key))
    first, second = outputs
    assert first["counts"] == {
        "prompts": 11,
        "duplicate_prompts": 1,
        "asked": 10,
        "answered": 6,
        "errors": 4,
        "refused_by_harm": 1,
        "duplicates": 1,
        "kept": 4,
    }
    kinds = first["errors_by_kind"]
    assert sum(kinds.values()) == 4 and kinds.get("ResponseRefused") == 2, kinds  # huge, slow
    assert kinds.get("RuntimeError") == 1 and kinds.get("JSONDecodeError") == 1, kinds  # 500, not JSON
    for name in ("sft.jsonl", "rejected.jsonl"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert first["fingerprint"] == second["fingerprint"]
    manifest = json.loads((tmp_path / "one" / "_MANIFEST.json").read_text())
    assert manifest["counts"] == first["counts"] and manifest["fingerprint"] == first["fingerprint"]

    rows = [json.loads(line) for line in (tmp_path / "one" / "sft.jsonl").read_text().splitlines()]
    assert [list(r) for r in rows] == [["messages"]] * 4
    assert rows[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [r["messages"][-1]["content"] for r in rows][0] == "The answer to 'What is a kettle?' is 17."
    template = ChatTemplate()
    for r in rows:
        rendered = template.render(r["messages"])
        assert rendered.endswith(f"{r['messages'][-1]['content']}<|im_end|>\n<|im_start|>assistant\n")
    rejected = {r["id"]: r for r in map(json.loads, (tmp_path / "one" / "rejected.jsonl").read_text().splitlines())}
    assert {k: v["reason"] for k, v in rejected.items()} == {
        "a-again": "duplicate_prompt",
        "e1": "error",
        "e2": "error",
        "e3": "error",
        "e4": "error",
        "h": "harm",
        "s2": "duplicate_answer",
    }
    assert "larger than 100000 bytes" in rejected["e3"]["detail"]
    assert "longer than 0.6 s" in rejected["e4"]["detail"]


def test_a_rerun_skips_committed_output(tmp_path, teacher_url):
    prompts = write_pool(tmp_path / "prompts.jsonl", POOL[:2])
    cfg = DistillConfig(
        prompts=prompts,
        output=str(tmp_path / "out"),
        teacher={"url": teacher_url, "model": "t"},
        max_tokens=32,
        harm={"offensive_language": False},
    )
    first = run_distill(cfg, exact_key)
    assert first["counts"]["kept"] == 2
    assert run_distill(cfg, exact_key)["counts"] == first["counts"]  # read back from card.json, not redone


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one of 'prompt'"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "last message"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"prompt": "x", "extra": 1}, "extra"),
        ({"prompt": "x" * 50}, "max_prompt_chars=40"),
        ([1, 2], "line"),
    ],
)
def test_a_malformed_prompt_pool_is_refused_naming_the_line(tmp_path, row, message):
    path = write_pool(tmp_path / "p.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(ValueError, match=message) as e:
        read_prompt_pool(path, max_prompts=10, max_chars=40)
    assert f"{path}:2" in str(e.value)
    with pytest.raises(ValueError, match="more than max_prompts=1"):
        read_prompt_pool(write_pool(tmp_path / "q.jsonl", [{"prompt": "a"}, {"prompt": "b"}]), 1, 40)


def test_a_checkpoint_teacher_through_the_command(tmp_path, capsys):
    """The job wires curation's exact-dedup key into the align stage; the teacher is a tiny
    checkpoint with random weights, run in this process."""
    import torch

    from lmfoundry.jobs.distill import main
    from tests.test_export import make_checkpoint

    make_checkpoint(tmp_path / "ckpt")
    prompts = write_pool(tmp_path / "prompts.jsonl", [{"prompt": "def add(a, b):"}, {"prompt": "The quick fox"}])
    recipe = tmp_path / "distill.yaml"
    recipe.write_text(f"prompts: {prompts}\nteacher: {{checkpoint: {tmp_path / 'ckpt'}}}\nmax_tokens: 6\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([str(recipe), "--output", str(tmp_path / "out"), "--set", "harm.offensive_language=false"]) == 0
    finally:
        torch.set_num_threads(threads)
    card = json.loads(capsys.readouterr().out)
    counts = card["counts"]
    assert counts["asked"] == 2 and counts["answered"] + counts["errors"] == 2
    assert counts["kept"] == counts["answered"] - counts["refused_by_harm"] - counts["duplicates"]
    assert card["teacher"] == str(tmp_path / "ckpt")
    assert main([str(recipe), "--output", str(tmp_path / "bad"), "--set", "bogus=1"]) == 2


# A synthetic task: a review's polarity, said first, then why. The review words are the teacher's
# lexicon. A fifth of the (thing, word) clauses are held out: the held-out reviews are made of
# those only, so none of their clauses ("the soup was stale") is in the training reviews.
GOOD = "great friendly fast clean fresh tasty warm helpful quiet lovely cheap polite".split()
BAD = "awful rude slow dirty stale bland cold useless noisy nasty pricey late".split()
NOUNS = "food staff service room coffee bread soup waiter table music bill view".split()
QUESTION = "Review: the {} was {} and the {} was {}. Positive or negative?"


def reviews(count: int, seed: int, held_out: bool) -> list[str]:
    import random

    def clause(rng, words):
        while True:
            noun, word = rng.choice(NOUNS), rng.choice(words)
            if ((NOUNS.index(noun) + (GOOD + BAD).index(word)) % 5 == 0) == held_out:
                return noun, word

    rng, out = random.Random(seed), {}
    while len(out) < count:
        words = GOOD if rng.random() < 0.5 else BAD
        (first, a), (second, b) = clause(rng, words), clause(rng, words)
        if first != second:
            out[QUESTION.format(first, a, second, b)] = None
    return list(out)


def label(review: str) -> str:
    return "positive" if set(review.replace(".", " ").split()) & set(GOOD) else "negative"


class ReviewTeacher(BaseHTTPRequestHandler):
    """A rule-based teacher behind the OpenAI chat API: the polarity by its lexicon, and the
    review itself as the reason (so no two answers are the same)."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        review = request["messages"][-1]["content"]
        reason = review.split(". ")[0].removeprefix("Review: ")
        answer = {"role": "assistant", "content": f"{label(review)}, because {reason}."}
        body = json.dumps({"choices": [{"message": answer, "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_student_distilled_from_a_teacher_scores_higher_on_held_out_reviews(deepspeed_workers, tmp_path):
    """Sequence-level distillation end to end: the teacher endpoint answers 300 reviews, the
    answers become SFT data, a small random student is fine-tuned on them on Ray Train, and the
    evaluation suite scores the student before and after on 50 reviews whose clauses it never saw
    (the polarity it generates first, exact match), with the gate against the score before."""
    import yaml

    from lmfoundry.eval.suite import EvaluateConfig, run_evaluate
    from lmfoundry.jobs.sft import SFTJobConfig, run_sft_job

    train, held_out = reviews(300, seed=0, held_out=False), reviews(50, seed=1, held_out=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), ReviewTeacher)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        card = run_distill(
            DistillConfig(
                prompts=write_pool(tmp_path / "prompts.jsonl", [{"prompt": q} for q in train]),
                output=str(tmp_path / "distilled"),
                teacher={"url": f"http://127.0.0.1:{server.server_address[1]}", "model": "teacher"},
                max_tokens=32,
                harm={"offensive_language": False},
            ),
            exact_key,
        )
    finally:
        server.shutdown()
    assert card["counts"]["kept"] == 300, card["counts"]

    # the student: random weights, a tokenizer trained on the training prompts and the template
    template = ChatTemplate()
    student = build_chat_checkpoint(tmp_path / "student", train, copyable=True)

    # the held-out split as a harness-format task: the chat prompt, the polarity before the comma
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    docs = [{"prompt": template.render([{"role": "user", "content": q}]), "label": label(q)} for q in held_out]
    (tasks / "reviews.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "reviews.yaml").write_text(
        yaml.safe_dump(
            {
                "task": "review_polarity",
                "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"test": "reviews.jsonl"}},
                "test_split": "test",
                "output_type": "generate_until",
                "doc_to_text": "{{prompt}}",
                "doc_to_target": "{{label}}",
                "target_delimiter": "",
                "generation_kwargs": {"until": [","], "max_gen_toks": 4},
                "metric_list": [{"metric": "exact_match"}],
            }
        )
    )

    def score(ckpt, name, **gate):
        cfg = EvaluateConfig(checkpoint=str(ckpt), tasks=[str(tasks)], output=str(tmp_path / name), gate=gate)
        report = run_evaluate(cfg)
        return report["metrics"]["task.review_polarity.exact_match"], report

    before, _ = score(student, "eval-before")
    result = run_sft_job(
        SFTJobConfig(
            checkpoint=str(student),
            data=str(tmp_path / "distilled" / "sft.jsonl"),
            output=str(tmp_path / "sft"),
            optimizer={"lr": 3e-3},
            schedule={"warmup_steps": 5, "max_steps": 300},
            batch={"micro_batch_size": 6, "global_batch_sequences": 6},
            parallelism={"num_workers": 1, "zero_stage": 1, "cpus_per_worker": 1},
            checkpointing={"every": 300},
        )
    )
    assert result["data_report"]["trained"] == card["counts"]["kept"]
    after, report = score(
        tmp_path / "sft" / result["final_checkpoint"],
        "eval-after",
        baseline=str(tmp_path / "eval-before" / "eval.json"),
        track=["task.review_polarity.exact_match"],
    )
    assert before <= 0.1 and after >= 0.8, (before, after)
    assert report["gate"]["passed"]
