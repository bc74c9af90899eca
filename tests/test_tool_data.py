"""Tool-use conversations for the orders workflow: the SQL in them runs and gives the results they
show, the answers state what the database holds, the test split's phrasings and customers are
never in training, the same bytes twice, and the text is what the agent service renders."""

import hashlib
import json
import sqlite3

import pytest
import yaml

from lmfoundry.agents.tool_data import (
    PHRASINGS,
    VARIANTS,
    Reference,
    ToolDataConfig,
    close_to,
    run_tool_data,
    split_phrasings,
    verify_answer,
)
from lmfoundry.agents.workflow import load_workflows
from lmfoundry.jobs.agents import demo_data
from lmfoundry.model.chat_template import ChatTemplate
from lmfoundry.serving.grammar import check_schema, tool_call_schema
from lmfoundry.serving.protocol import ChatCompletionRequest
from lmfoundry.serving.tool_calls import parse_tool_calls

ORDERS_WORKFLOW = "configs/workflows/orders.yaml"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo database and corpus, and the shipped orders workflow pointed at them."""
    root = tmp_path_factory.mktemp("agents")
    made = demo_data(str(root))
    spec = yaml.safe_load(open(ORDERS_WORKFLOW))
    tools = spec["workflows"]["orders_and_docs"]["tools"]
    tools["sql"]["dsn"], tools["docs"]["corpus"] = made["orders"], made["docs"]
    path = root / "orders.yaml"
    path.write_text(
        yaml.safe_dump({"workflows": {"orders_and_docs": spec["workflows"]["orders_and_docs"]}}, sort_keys=False)
    )
    return {"workflows": str(path), "db": made["orders"], "root": root}


@pytest.fixture(scope="module")
def made(demo):
    outs = []
    for run in ("one", "two"):
        cfg = ToolDataConfig(
            workflows=demo["workflows"], output=str(demo["root"] / run), train_size=70, test_size=35, seed=3
        )
        outs.append(run_tool_data(cfg))
    return {"dir": demo["root"] / "one", "results": outs}


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_same_inputs_give_the_same_bytes(made, demo):
    first, second = made["results"]
    assert first["fingerprint"] == second["fingerprint"]
    for name in ("train.jsonl", "test.jsonl", "questions.jsonl", "rejected.jsonl"):
        assert (made["dir"] / name).read_bytes() == (demo["root"] / "two" / name).read_bytes()
    assert first["counts"]["train"]["conversations"] == 70 and first["counts"]["test"]["conversations"] == 35
    assert len(first["counts"]["test"]["by_intent"]) == 7  # round-robin: every intent in a small split


def expected_facts(db, docs: dict, intent: str, v: dict) -> list[str]:
    """What the answer must say, asked of the database here, not through the generator (numbers
    as the tool's JSON shows them)."""
    one = lambda sql, *args: db.execute(sql, args).fetchone()  # noqa: E731
    if intent == "spend":
        return [json.dumps(one("SELECT SUM(total) FROM orders WHERE customer = ?", v["customer"])[0])]
    if intent == "count":
        return [str(one("SELECT COUNT(*) FROM orders WHERE customer = ?", v["customer"])[0])]
    if intent == "items":
        return [r[0] for r in db.execute("SELECT item FROM orders WHERE customer = ?", (v["customer"],))]
    if intent == "paid":
        return [
            json.dumps(one("SELECT total FROM orders WHERE customer = ? AND item = ?", v["customer"], v["item"])[0])
        ]
    status, item, customer = one("SELECT status, item, customer FROM orders WHERE id = ?", v["order"])
    if intent == "status":
        return [status]
    if intent == "contents":
        return [item, customer]
    return [status, docs[{"returned": "refunds", "shipped": "shipping", "pending": "pending"}[status]]]


def test_every_query_runs_and_every_answer_matches_the_database(made, demo):
    db = sqlite3.connect(demo["db"])
    docs = {d["id"]: d["text"] for d in read(demo["root"] / "docs.jsonl")}
    asked = read(made["dir"] / "questions.jsonl")
    rows = read(made["dir"] / "train.jsonl") + read(made["dir"] / "test.jsonl")
    assert len(rows) == len(asked)
    for row, q in zip(rows, asked):
        messages = row["messages"]
        assert messages[1] == {"role": "user", "content": q["question"]}
        calls = [m["tool_calls"][0] for m in messages if m["role"] == "assistant"]
        results = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
        assert calls[0]["function"]["name"] == "sql" and calls[-1]["function"]["name"] == "final_answer"
        query = json.loads(calls[0]["function"]["arguments"])["query"]
        shown = json.loads(results[calls[0]["id"]].split("\n")[1])  # inside the untrusted-output wrapper
        assert shown["rows"] == [list(r) for r in db.execute(query).fetchall()], query
        answer = json.loads(calls[-1]["function"]["arguments"])["answer"]
        assert answer == q["answer"] and len(answer) <= 64
        for fact in expected_facts(db, docs, q["intent"], q["values"]):
            assert fact in answer, (q, answer)


def test_the_verifier_refuses_answers_the_database_contradicts(demo):
    ref = Reference.read(load_workflows(demo["workflows"])["orders_and_docs"])
    acme = [o for o in ref.orders if o["customer"] == "acme"]
    spent = round(sum(o["total"] for o in acme), 2)
    assert verify_answer("spend", {"customer": "acme"}, f"acme spent {spent:.2f} in total.", ref) is None
    assert "does not state" in verify_answer("spend", {"customer": "acme"}, f"acme spent {spent + 1:.2f}.", ref)
    order = acme[0]
    wrong = next(s for s in ("shipped", "returned", "pending") if s != order["status"])
    assert "does not say" in verify_answer("status", {"order": order["id"]}, f"Order {order['id']} is {wrong}.", ref)
    policy = f"Order {order['id']} is {order['status']}. Orders are final."
    assert "does not say" in verify_answer("policy", {"order": order["id"]}, policy, ref)
    # an answer that states every value is not right by accident
    every = f"acme spent {spent:.2f} or {spent + 5:.2f} in total."
    assert "also states" in verify_answer("spend", {"customer": "acme"}, every, ref)
    statuses = f"Order {order['id']} is {order['status']} or {wrong}."
    assert "also says" in verify_answer("status", {"order": order["id"]}, statuses, ref)


def test_the_test_split_holds_out_phrasings_and_values(made):
    asked = read(made["dir"] / "questions.jsonl")
    train = [q for q in asked if q["split"] == "train"]
    test = [q for q in asked if q["split"] == "test"]
    assert not {q["template"] for q in train} & {q["template"] for q in test}
    test_customers = {q["values"]["customer"] for q in test if "customer" in q["values"]}
    test_orders = {q["values"]["order"] for q in test if "order" in q["values"]}
    assert test_customers and test_orders
    assert not test_customers & {q["values"].get("customer") for q in train}
    assert not test_orders & {q["values"].get("order") for q in train}
    train_text = (made["dir"] / "train.jsonl").read_text()
    for customer in test_customers:  # not in a question, a query, a tool result or an answer
        assert f"'{customer}'" not in train_text and f" {customer} " not in train_text


def test_training_variants_are_never_close_to_a_held_out_phrasing_and_only_training_is_reworded(made):
    import random

    for seed in range(20):  # whichever phrasings a seed holds out
        split = split_phrasings(2, random.Random(seed), variants=True)
        held = [t for ts in split["test"].values() for t in ts]
        for intent, templates in split["train"].items():
            extra = [t for t in templates if t not in PHRASINGS[intent]]
            assert extra and set(extra) <= set(VARIANTS[intent])
            assert not any(close_to(t, held) for t in extra)
    # a near copy is caught: most of its words shared, the slot and punctuation aside
    assert close_to("What's the status of order {order}", ["What is the status of order {order}?"])
    assert close_to("Who placed order {order}?", ["Who placed order {order} and what was it?"])  # a part of it
    assert not close_to("Which rules cover order {order}?", ["What is the status of order {order}?"])
    asked = read(made["dir"] / "questions.jsonl")
    for q in asked:
        if q["split"] == "test":
            assert q["question"] == q["template"].format(**q["values"])
        for value in q["values"].values():  # as stored: rewording changes the phrasing's case only
            assert str(value) in q["question"]
    train = [q for q in asked if q["split"] == "train"]
    assert any(q["template"] not in PHRASINGS[q["intent"]] for q in train)
    assert any(q["question"] != q["template"].format(**q["values"]) for q in train)


def test_a_conversation_renders_as_the_agent_service_prompts_the_model(made):
    """Each assistant turn follows, token for token, the prompt the serving API renders for the
    worker's request at that step (tool_choice required), and parses as the call it records."""
    template = ChatTemplate()
    row = next(r for r in read(made["dir"] / "train.jsonl") if len(r["messages"]) == 7)  # sql, docs, answer
    # within the server's static limits (maxLength <= 64); tests/test_grammar.py compiles them
    check_schema(tool_call_schema([t["function"] for t in row["tools"]], None))
    whole = template.render(row["messages"], row["tools"])
    turns = [k for k, m in enumerate(row["messages"]) if m["role"] == "assistant"]
    for k in turns:
        request = ChatCompletionRequest(
            model="lmfoundry", messages=row["messages"][:k], tools=row["tools"], tool_choice="required"
        )
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        offered = [{"type": "function", "function": t} for t in request.tools_offered()]
        prompt = template.render(messages, offered, force_tool_call=True)
        assert whole.startswith(prompt)
        reply = whole[len(prompt) :].split("</tool_call>")[0]
        call = row["messages"][k]["tool_calls"][0]["function"]
        names = [t["function"]["name"] for t in row["tools"]]
        calls, _ = parse_tool_calls(reply, names, forced=True)
        assert [(c.name, c.arguments) for c in calls] == [(call["name"], json.loads(call["arguments"]))]


def test_practice_customers_train_on_their_own_database_and_never_see_a_held_out_row(demo, tmp_path):
    """Invented customers widen the training split (so a model learns to read the name in the
    question); their conversations ran against practice.sqlite, which holds the real training rows
    and the invented ones, and no held-out customer's row or order id."""
    cfg = ToolDataConfig(
        workflows=demo["workflows"], output=str(tmp_path / "p"), train_size=300, test_size=30, practice_customers=40
    )
    card = run_tool_data(cfg)
    practice = sqlite3.connect(tmp_path / "p" / "practice.sqlite")
    real = sqlite3.connect(demo["db"])
    asked = read(tmp_path / "p" / "questions.jsonl")
    test = [q for q in asked if q["split"] == "test"]
    held = {q["values"]["customer"] for q in test if "customer" in q["values"]}
    held_ids = {
        r[0] for r in real.execute(f"SELECT id FROM orders WHERE customer IN ({','.join('?' * len(held))})", [*held])
    }
    practice_rows = practice.execute("SELECT id, customer FROM orders").fetchall()
    assert not held & {c for _, c in practice_rows} and not held_ids & {i for i, _ in practice_rows}
    invented = {c for _, c in practice_rows} - {r[0] for r in real.execute("SELECT customer FROM orders")}
    assert len(invented) == 40
    train_customers = {q["values"].get("customer") for q in asked if q["split"] == "train"} - {None}
    assert len(train_customers & invented) > 20 and card["counts"]["train"]["customers"] == 40 + 7
    # a training conversation's query gives, on the practice database, the rows the conversation shows
    for row in read(tmp_path / "p" / "train.jsonl")[:50]:
        call = row["messages"][2]["tool_calls"][0]
        shown = json.loads(row["messages"][3]["content"].split("\n")[1])
        assert shown["rows"] == [list(r) for r in practice.execute(json.loads(call["function"]["arguments"])["query"])]
    # the test split still asks the real database
    for row, q in zip(read(tmp_path / "p" / "test.jsonl"), test):
        query = json.loads(row["messages"][2]["tool_calls"][0]["function"]["arguments"])["query"]
        assert json.loads(row["messages"][3]["content"].split("\n")[1])["rows"] == [
            list(r) for r in real.execute(query)
        ], q


@pytest.mark.parametrize("bad", [-1, 10_001, "many", 2.5])
def test_practice_customers_out_of_bounds_or_not_a_count_is_refused(demo, tmp_path, bad):
    with pytest.raises(ValueError, match="practice_customers"):
        ToolDataConfig(workflows=demo["workflows"], output=str(tmp_path / "x"), practice_customers=bad)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("bad", ["maybe", 2, [True], {"on": True}])
def test_variants_that_is_not_a_yes_or_no_is_refused(demo, tmp_path, bad):
    with pytest.raises(ValueError, match="variants"):
        ToolDataConfig(workflows=demo["workflows"], output=str(tmp_path / "x"), variants=bad)
    assert not (tmp_path / "x").exists()


def test_a_workflow_without_the_tools_is_refused(demo, tmp_path):
    spec = yaml.safe_load(open(demo["workflows"]))
    del spec["workflows"]["orders_and_docs"]["tools"]["docs"]
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match="exactly one sql and one search tool"):
        run_tool_data(ToolDataConfig(workflows=str(path), output=str(tmp_path / "out")))
    with pytest.raises(ValueError, match="'nope' is not in"):
        run_tool_data(ToolDataConfig(workflows=demo["workflows"], workflow="nope", output=str(tmp_path / "out")))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A copyable BPE like the agent model's, on a slice of the sample corpus."""
    from lmfoundry.data.sample_corpus import stdlib_documents
    from lmfoundry.data.tokenizer import train_bpe
    from lmfoundry.platform import checkpoint

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_bpe(stdlib_documents(200), vocab_size=1024, copyable=True).to_str())
    checkpoint.seal(path.parent, {"step": 0})  # a checkpoint holding only its tokenizer
    return path


def test_piece_names_are_the_tokenizers_pieces_each_dealt_before_any_is_dealt_twice(tokenizer_file):
    """Each name splits back into the pieces it was made of; one deck's worth of names holds
    every piece; no name is taken; every name fits the queries' 64 characters."""
    import random

    from tokenizers import Tokenizer

    from lmfoundry.agents.tool_data import LETTER_DEALS, NAME_CHARS, piece_names, word_pieces

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    pieces = word_pieces(tokenizer)
    assert len(pieces) > 300 and all(tokenizer.encode(p).tokens == [p] for p in pieces)
    deck = len(pieces) + (LETTER_DEALS - 1) * sum(len(p) == 1 for p in pieces)
    names = piece_names(deck // 2, {"globex"}, random.Random(0), pieces, tokenizer)
    assert len(names) == deck // 2 and "globex" not in names
    assert all(5 <= len(n) <= NAME_CHARS and n.isalpha() and n.islower() for n in names)
    split = [tokenizer.encode(n).tokens for n in names]
    assert sum(len(s) >= 2 and set(s) <= set(pieces) for s in split) >= 0.95 * len(names)
    assert len({t for s in split for t in s} & set(pieces)) >= 0.95 * len(pieces)  # one deck: nearly every piece


def test_every_subject_is_asked_once_before_any_twice_and_the_intents_share_them_out():
    """Within an intent, every customer (or order) is asked about once before any twice; the
    intents about customers start at evenly spaced places of one order, so their first questions
    together name every customer."""
    import random
    from collections import Counter

    from lmfoundry.agents.tool_data import questions

    customers = [f"c{i}" for i in range(30)]
    values = {"customer": customers, "order": list(range(30)), "customer_item": [(c, "lamp") for c in customers]}
    intents = ("spend", "count", "items", "paid", "status")
    phrasings = {intent: list(PHRASINGS[intent][:4]) for intent in intents}
    asked = questions(phrasings, values, 5 * 100, random.Random(0))
    for intent in intents:
        key = "order" if intent == "status" else "customer"
        mine = [q["values"][key] for q in asked if q["intent"] == intent]
        assert len(mine) == 100 and [Counter(mine[: 30 * k]) for k in (1, 2, 3)] == [
            Counter({v: k for v in values[key]}) for k in (1, 2, 3)
        ]
        assert len({q["template"] for q in asked if q["intent"] == intent}) == 4
    first = questions(phrasings, values, 5 * 8, random.Random(1))  # 8 of each intent: 32 about customers
    assert {q["values"]["customer"] for q in first if q["intent"] != "status"} == set(customers)


def test_name_pieces_makes_the_practice_names_and_counts_the_pieces_written(demo, tmp_path, tokenizer_file):
    """Half the practice names are made of the tokenizer's pieces: the training answers write
    far more of its pieces inside a name than the same run's invented names alone do."""
    from tokenizers import Tokenizer

    from lmfoundry.agents.tool_data import pieces_written, word_pieces

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    pieces = word_pieces(tokenizer)
    real = {r[0] for r in sqlite3.connect(demo["db"]).execute("SELECT customer FROM orders")}
    written = {}
    for run, extra in (("pieces", {"name_pieces": str(tokenizer_file.parent)}), ("invented", {})):
        cfg = ToolDataConfig(
            workflows=demo["workflows"],
            output=str(tmp_path / run),
            train_size=300,
            test_size=30,
            practice_customers=80,
            **extra,
        )
        card = run_tool_data(cfg)
        db = sqlite3.connect(tmp_path / run / "practice.sqlite")
        invented = {r[0] for r in db.execute("SELECT customer FROM orders")} - real
        assert len(invented) == 80
        answers = [q["answer"] for q in read(tmp_path / run / "questions.jsonl") if q["split"] == "train"]
        written[run] = pieces_written(tokenizer, pieces, invented, answers)
        if run == "pieces":
            assert card["name_pieces"] == {
                "tokenizer_sha256": hashlib.sha256(tokenizer_file.read_bytes()).hexdigest(),
                **written[run],
            }
            split_back = [
                n
                for n in invented
                if "".join(tokenizer.encode(n).tokens) == n
                and set(tokenizer.encode(n).tokens) <= set(pieces)
                and len(tokenizer.encode(n).tokens) >= 2
            ]
            assert len(split_back) >= 40
    assert written["pieces"]["names_written"] == written["invented"]["names_written"] == 80
    assert written["pieces"]["written_in_a_name"] > 1.3 * written["invented"]["written_in_a_name"], written


def test_piece_names_refuse_pieces_that_cannot_make_enough_names():
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    from lmfoundry.agents.tool_data import piece_names, word_pieces

    words = ["alpha", "bravo", "charly", "delta", "echoes", "foxtro", "golfer", "hotels", "indias", "juliet"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words + ["[UNK]"])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    pieces = word_pieces(tokenizer)
    assert pieces == sorted(words)
    names = piece_names(20, set(), random.Random(0), pieces, tokenizer)
    assert len(names) == 20 and all(len(n) <= 12 for n in names)
    with pytest.raises(ValueError, match=r"10 word pieces made \d+ different names, not the 200 asked for"):
        piece_names(200, set(), random.Random(0), pieces, tokenizer)


@pytest.mark.parametrize(
    "what, content, match",
    [
        ("missing", None, "no tokenizer at"),
        ("not json", b"\x00\xff not a tokenizer", "is not a tokenizers JSON file"),
        ("another json", b'{"model": {"type": "Nope"}}', "is not a tokenizers JSON file"),
        ("too big", b" " * (64 * 2**20 + 1), "a tokenizer here is at most"),
        ("no letters", None, "lowercase word pieces"),
    ],
)
def test_name_pieces_that_is_not_a_usable_tokenizer_is_refused_and_writes_nothing(demo, tmp_path, what, content, match):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tok.json"
    if content is not None:
        path.write_bytes(content)
    elif what == "no letters":
        Tokenizer(models.BPE(vocab={"1": 0, "2": 1}, merges=[])).save(str(path))
    cfg = ToolDataConfig(
        workflows=demo["workflows"], output=str(tmp_path / "out"), practice_customers=5, name_pieces=str(path)
    )
    with pytest.raises(ValueError, match=match):
        run_tool_data(cfg)
    assert not (tmp_path / "out").exists()


def test_name_pieces_without_practice_customers_is_refused(demo, tmp_path, tokenizer_file):
    with pytest.raises(ValueError, match="practice_customers > 0"):
        ToolDataConfig(workflows=demo["workflows"], output=str(tmp_path / "x"), name_pieces=str(tokenizer_file))


def test_name_pieces_from_a_checkpoint_is_read_checked_against_its_manifest(demo, tmp_path, tokenizer_file):
    import shutil

    changed = tmp_path / "changed"
    shutil.copytree(tokenizer_file.parent, changed)
    (changed / "tokenizer.json").write_text(tokenizer_file.read_text() + " ")  # after the checkpoint was sealed
    for name_pieces, match in ((changed, "checksum"), (tmp_path, "no tokenizer: .* is neither a checkpoint")):
        cfg = ToolDataConfig(
            workflows=demo["workflows"],
            output=str(tmp_path / "out"),
            practice_customers=5,
            name_pieces=str(name_pieces),
        )
        with pytest.raises(ValueError, match=match):
            run_tool_data(cfg)
        assert not (tmp_path / "out").exists()
