"""Verified tool-use conversations for the orders demo workflow (configs/workflows/orders.yaml):
supervised fine-tuning data that teaches a small model to answer through the agent's tools.

    lmfoundry tool-data configs/tool_data.yaml --output work/tool_data

The teacher is rule-based. A question is a phrasing (a template) filled with values drawn from
the workflow's real database: a customer, an order, an item. Its intent fixes the tool calls
(SQL, and for policy questions a search of the policy corpus); each call runs through the same
tool implementations the agent service runs (agents/tools.py, built from the workflow by
`build_registry`), and the final answer is composed from the tool's real result. The
conversation is the one the agent worker would show the model (`worker.conversation`: the
workflow's system prompt, the untrusted-output wrapping, the `final_answer` tool), so training
and serving see the same text.

A conversation is kept only when its verifier passes it, as align/synth.py's samples are: every
call succeeded, and the answer states the facts read from the database (and corpus) directly,
not through the tool. What fails goes to `rejected.jsonl` with the reason.

The test split holds out phrasings (`test_phrasings` per intent) and values (a share of the
customers, with their orders and items): no test question's template or customer, order or
item row appears in a training conversation.

A model trained on a handful of customers learns their names, not to read the name in the
question: `practice_customers` adds that many invented customers, with orders of their own, to
the training split. They live in a practice database (`practice.sqlite` in the output: the real
database's training rows plus the invented ones, never a held-out row), which the training
split's tools run against; the test split asks the real database about the held-out customers.
A held-out name is written in word pieces of the model's tokenizer, and a small model does not
write a piece at a name's place that no training name had: with `name_pieces` (the model's
tokenizer), half the invented names are made of that tokenizer's word pieces, nearly every piece
in some name.
Within an intent, every value is asked about once before any is asked twice, so that the training
split names every practice customer it can.
Answers state numbers as the tool showed them, so the model copies them rather than reformats.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import sqlite3
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import quote

from pydantic import Field, model_validator

from lmfoundry.agents import tools as toolkit
from lmfoundry.agents.worker import Guard, conversation, tool_text
from lmfoundry.agents.workflow import WorkflowConfig, build_registry, final_answer_spec, load_workflows
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.corpus import read_documents
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


class ToolDataConfig(StageConfig):
    workflows: str = Field("configs/workflows", description="a workflow YAML file or a folder of them")
    workflow: str = Field("orders_and_docs", description="the workflow the conversations are for")
    output: str
    train_size: int = Field(2000, ge=1, le=1_000_000, description="at most this many training conversations")
    test_size: int = Field(200, ge=1, le=1_000_000, description="at most this many test conversations")
    test_phrasings: int = Field(2, ge=1, description="phrasings of each intent held out for the test split")
    test_share: float = Field(0.3, gt=0, lt=1, description="share of the customers (and their orders) held out")
    variants: bool = Field(
        True, description="train on VARIANTS' phrasings too, reworded (openers, case); the test split never is"
    )
    practice_customers: int = Field(
        0, ge=0, le=10_000, description="invented customers (with orders) added to the training split only"
    )
    name_pieces: str | None = Field(
        None,
        description="the model's tokenizer (tokenizer.json, or a checkpoint holding one): half the practice "
        "customers' names are made of its word pieces",
    )
    seed: int = 0
    overwrite: bool = False

    @model_validator(mode="after")
    def _pieces_need_practice_customers(self):
        if self.name_pieces and not self.practice_customers:
            raise ValueError("name_pieces makes the practice customers' names: set practice_customers > 0 too")
        return self


# --- intents --------------------------------------------------------------------------------------
# Each intent: the slots its phrasings take, the phrasings, and how the rule-based teacher and the
# verifier treat it (`calls`, `compose` and `facts` below). Slots: customer, order, item.

PHRASINGS = {
    "spend": (
        "What did {customer} spend?",
        "How much has {customer} spent in total?",
        "What is the total value of {customer}'s orders?",
        "Sum up everything {customer} has ordered.",
        "How much money did {customer} spend with us?",
        "Total spend for {customer}?",
        "Can you tell me what {customer} has paid for all its orders?",
        "what's {customer}'s total spend",
    ),
    "count": (
        "How many orders has {customer} placed?",
        "How many orders does {customer} have?",
        "Count the orders of {customer}.",
        "What is the number of orders from {customer}?",
        "how many times has {customer} ordered",
        "Number of orders for {customer}?",
        "Tell me how many orders {customer} made.",
        "How many purchases did {customer} make?",
    ),
    "items": (
        "What has {customer} ordered?",
        "Which items did {customer} buy?",
        "List the products {customer} ordered.",
        "What did {customer} order from us?",
        "which items has {customer} bought",
        "Items ordered by {customer}?",
        "Tell me everything {customer} has ordered.",
        "What products are in {customer}'s orders?",
    ),
    "status": (
        "What is the status of order {order}?",
        "Where is order {order}?",
        "Has order {order} shipped?",
        "Order {order}: what's its status?",
        "Can you check the status of order number {order}?",
        "status of order {order}",
        "What happened to order #{order}?",
        "Is order {order} shipped, pending or returned?",
    ),
    "contents": (
        "What was in order {order}?",
        "Which item did order {order} contain?",
        "What did order {order} buy, and for whom?",
        "Who placed order {order} and what was it?",
        "order {order}: which product?",
        "Tell me what order number {order} was for.",
        "What product is order #{order}?",
        "Look up the item and customer of order {order}.",
    ),
    "paid": (
        "What did {customer} pay for the {item}?",
        "How much was {customer}'s {item}?",
        "What did the {item} cost {customer}?",
        "Price of the {item} {customer} ordered?",
        "How much did {customer} spend on a {item}?",
        "what did {customer} pay for their {item}",
        "Tell me the total of {customer}'s {item} order.",
        "How much was charged to {customer} for the {item}?",
    ),
    "policy": (
        "What is the status of order {order}, and what does our policy say about it?",
        "Order {order}: what is its status and which policy applies?",
        "Check order {order} and tell me the relevant policy.",
        "What's going on with order {order}, and what are the rules for that?",
        "Look up order {order} and quote the policy for its status.",
        "For order #{order}, give the status and the matching policy.",
        "what is the status of order {order} and what policy covers it",
        "Can you tell me about order {order} and the policy for it?",
    ),
}
# Training-only variety: more ways to ask each intent, so that a model learns the words that
# decide one (spend, cost, rules, who, ...) rather than eight sentences. The test split asks only
# PHRASINGS' held-out templates; `split_phrasings` drops every variant close to one of them
# (`close_to`).
VARIANTS = {
    "spend": (
        "How much has {customer} paid us altogether?",
        "Total amount spent by {customer}?",
        "What's the sum of all of {customer}'s orders?",
        "How much money has {customer} spent so far?",
        "What has {customer} spent with us in total?",
        "Give me {customer}'s total spending.",
        "How much did {customer} spend overall?",
        "{customer}: total spent?",
        "Add up the totals of {customer}'s orders.",
        "Total order value for {customer}?",
        "What do {customer}'s orders come to altogether?",
        "Overall, how much has {customer} spent?",
    ),
    "count": (
        "How many orders did {customer} place?",
        "What's the order count for {customer}?",
        "How many times did {customer} buy from us?",
        "How often has {customer} ordered?",
        "Number of purchases by {customer}?",
        "How many orders are there from {customer}?",
        "Count of {customer}'s orders?",
        "How many orders came from {customer}?",
        "Give me the number of orders {customer} placed.",
        "{customer}: how many orders?",
        "In how many orders did {customer} buy something?",
    ),
    "items": (
        "What did {customer} buy?",
        "Which products has {customer} purchased?",
        "List everything {customer} bought.",
        "What items are in {customer}'s orders?",
        "Show me what {customer} ordered.",
        "What has {customer} purchased from us?",
        "Which things did {customer} order?",
        "Products bought by {customer}?",
        "{customer}: which items?",
        "Name the items {customer} ordered.",
        "Which goods did {customer} order?",
    ),
    "status": (
        "What's the status of order {order}?",
        "Status for order #{order}?",
        "Has order {order} been shipped yet?",
        "Where's order {order} now?",
        "Is order {order} still pending?",
        "What state is order {order} in?",
        "Was order {order} returned?",
        "Track order {order} for me.",
        "Give me the status of order number {order}.",
        "Order #{order} status?",
        "What is going on with order {order}?",
        "Any news on order {order}?",
    ),
    "contents": (
        "What item was order {order}?",
        "Which product was in order #{order}?",
        "Who ordered order {order}, and what did they get?",
        "What was bought in order {order} and by whom?",
        "Order {order}: what item and which customer?",
        "Tell me the item and the customer of order {order}.",
        "Who bought what in order number {order}?",
        "Which customer placed order #{order}, and for what?",
        "Details of order {order}: item and customer?",
        "What did order {order} contain?",
    ),
    "paid": (
        "How much did {customer} pay for the {item}?",
        "What was the price of {customer}'s {item}?",
        "How much did the {item} cost for {customer}?",
        "What was {customer} charged for the {item}?",
        "The {item} that {customer} bought: how much?",
        "How much money did {customer} spend on the {item}?",
        "Cost of the {item} for {customer}?",
        "What was the total for {customer}'s {item}?",
        "{customer} bought a {item}: what did it cost?",
        "How much is {customer}'s {item} order?",
        "What price did {customer} pay for a {item}?",
    ),
    "policy": (
        "What is the status of order {order} and the policy that applies?",
        "Which policy applies to order {order}?",
        "What are the rules for order {order}?",
        "Order {order}: status and rules, please.",
        "Tell me the status of order #{order} and what the policy says.",
        "What does the policy say about order {order}?",
        "Status of order {order} plus the relevant rule?",
        "Look up order {order} and explain the rules that apply.",
        "Which rules cover order number {order}, given its status?",
        "What happens now with order {order} under our policy?",
        "Check order {order} and give me the policy for its status.",
    ),
}
# Openers and closers a training question may get, and its case and final punctuation varied.
OPENERS = ("Hi, ", "Hello! ", "Quick question: ", "Please tell me: ", "Hey, ", "I'd like to know: ")
CLOSERS = (" Thanks!", " Thank you.", " Please.", " Cheers.")


SLOTS = {
    "spend": ("customer",),
    "count": ("customer",),
    "items": ("customer",),
    "status": ("order",),
    "contents": ("order",),
    "paid": ("customer", "item"),
    "policy": ("order",),
}
# the policy document that governs an order in each status, and the search query that finds it
POLICY = {"returned": ("refunds", "refunds"), "shipped": ("shipping", "ship"), "pending": ("pending", "pending")}


def first_sql(intent: str, v: dict) -> str:
    """The SQL the rule-based teacher writes first (every intent starts at the orders table). Each
    fits the 64 characters constrained decoding allows a string (serving/grammar.py)."""
    customer = v.get("customer", "").replace("'", "''")  # values are data, quoted as SQL strings
    return {
        "spend": f"SELECT SUM(total) FROM orders WHERE customer='{customer}'",
        "count": f"SELECT COUNT(*) FROM orders WHERE customer='{customer}'",
        "items": f"SELECT item FROM orders WHERE customer='{customer}'",
        "status": f"SELECT status FROM orders WHERE id={v.get('order')}",
        "contents": f"SELECT item,customer FROM orders WHERE id={v.get('order')}",
        "paid": f"SELECT item,total FROM orders WHERE customer='{customer}'",
        "policy": f"SELECT status FROM orders WHERE id={v.get('order')}",
    }[intent]


def shown(x: float | int) -> str:
    """A number as the tool's JSON result shows it: the answer copies it."""
    return json.dumps(x)


def compose(intent: str, v: dict, rows: list[list]) -> str:
    """The final answer from the first call's rows (policy answers from two calls: `teach`)."""
    first = rows[0]
    if intent == "spend":
        return f"{v['customer']} spent {shown(first[0])} in total."
    if intent == "count":
        return f"{v['customer']} has placed {first[0]} order{'s' if first[0] != 1 else ''}."
    if intent == "items":
        return f"{v['customer']} ordered {', '.join(r[0] for r in rows)}."
    if intent == "status":
        return f"Order {v['order']} is {first[0]}."
    if intent == "contents":
        return f"Order {v['order']} was a {first[0]} for {first[1]}."
    if intent == "paid":
        totals = [total for item, total in rows if item == v["item"]]
        if not totals:
            raise toolkit.ToolError(f"no {v['item']} among the rows")
        return f"{v['customer']} paid {shown(totals[0])} for the {v['item']}."
    raise AssertionError(f"compose: {intent} answers from two calls")


# --- the reference: the database and corpus read directly, not through the tools --------------------


@dataclass
class Reference:
    orders: list[dict]  # id, customer, item, total, status
    policies: dict[str, str]  # document id -> text

    @classmethod
    def read(cls, wf: WorkflowConfig) -> Reference:
        sql = next((t for t in wf.tools.values() if t.kind == "sql"), None)
        if sql is None or sql.dsn is None or sql.dsn.startswith(("postgres://", "postgresql://")):
            raise ValueError(f"workflow {wf.name}: tool-data needs a sql tool on a SQLite file (dsn)")
        try:
            uri = f"file:{quote(sql.dsn.removeprefix('sqlite:///'))}?mode=ro"
            with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
                rows = conn.execute("SELECT id, customer, item, total, status FROM orders ORDER BY id").fetchall()
        except sqlite3.Error as e:
            raise ValueError(
                f"workflow {wf.name}: {sql.dsn}: {e} (tool-data needs the orders table: "
                "id, customer, item, total, status; `lmfoundry agents demo-data` writes one)"
            ) from None
        keys = ("id", "customer", "item", "total", "status")
        search = next((t for t in wf.tools.values() if t.kind == "search" and t.corpus), None)
        policies = {str(d["id"]): d["text"] for d in read_documents(search.corpus)} if search else {}
        return cls([dict(zip(keys, r)) for r in rows], policies)

    def order(self, order_id: int) -> dict:
        return next(o for o in self.orders if o["id"] == order_id)

    def vocabulary(self) -> set[str]:
        """The database's customers, items and statuses: words an answer can get wrong."""
        return {str(o[k]).lower() for o in self.orders for k in ("customer", "item", "status")}


def numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", text)]


def facts(intent: str, v: dict, ref: Reference) -> tuple[list[float], list[str]]:
    """(numbers, phrases) the answer must state, from the reference."""
    mine = [o for o in ref.orders if o["customer"] == v.get("customer")]
    if intent == "spend":
        return [round(sum(o["total"] for o in mine), 2)], [v["customer"]]
    if intent == "count":
        return [len(mine)], [v["customer"]]
    if intent == "items":
        return [], [v["customer"], *(o["item"] for o in mine)]
    if intent == "paid":
        return [sum(o["total"] for o in mine if o["item"] == v["item"])], [v["customer"], v["item"]]
    order = ref.order(v["order"])
    if intent == "status":
        return [v["order"]], [order["status"]]
    if intent == "contents":
        return [v["order"]], [order["item"], order["customer"]]
    document = POLICY[order["status"]][0]
    return [v["order"]], [order["status"], ref.policies.get(document, f"<no {document} document>")]


def verify_answer(intent: str, v: dict, answer: str, ref: Reference) -> str | None:
    """None when the answer states what the reference says and nothing it contradicts (no other
    number, customer, item or status: an answer that lists every value does not pass), else why not."""
    expected_numbers, phrases = facts(intent, v, ref)
    stated, text = numbers(answer), answer.lower()
    for x in expected_numbers:
        if not any(abs(x - y) < 0.005 for y in stated):
            return f"the answer {answer!r} does not state {x:g} (the database's value)"
    allowed = expected_numbers + numbers(" ".join(phrases))
    extra = [y for y in stated if not any(abs(x - y) < 0.005 for x in allowed)]
    if extra:
        return f"the answer {answer!r} also states {extra[0]:g}, which the question's facts do not hold"
    for phrase in phrases:
        if phrase.lower() not in text:
            return f"the answer {answer!r} does not say {phrase!r} (the database's or corpus's)"
    expected_words = set(re.findall(r"\w+", " ".join(phrases).lower()))
    wrong = sorted(w for w in ref.vocabulary() - expected_words if re.search(rf"\b{re.escape(w)}\b", text))
    if wrong:
        return f"the answer {answer!r} also says {wrong[0]!r}, which the database does not give for this question"
    return None


# --- the teacher --------------------------------------------------------------------------------------


def call_step(registry: toolkit.ToolRegistry, guard: Guard, tool: str, arguments: dict, n: int) -> tuple[dict, dict]:
    """(model step, tool step) as the worker writes them; the tool runs for real."""
    result = registry.call(tool, arguments)
    view = guard.redact(tool_text(result))[0]
    if guard.injected(view):
        raise toolkit.ToolError(f"{tool}'s output would be withheld from the model (it reads as instructions)")
    if not result.ok:
        raise toolkit.ToolError(f"{tool} failed: {result.error}")
    model = {"kind": "model", "n": n, "tool": tool, "arguments": arguments}
    return model, {"kind": "tool", "n": n + 1, "status": "done", "model_view": view, "output": result.output}


def teach(wf: WorkflowConfig, registry: toolkit.ToolRegistry, guard: Guard, question: dict) -> dict:
    """The conversation for one question: the calls, their real results and the composed answer."""
    sql_tool = next(name for name, t in wf.tools.items() if t.kind == "sql")
    intent, v = question["intent"], question["values"]
    steps = list(call_step(registry, guard, sql_tool, {"query": first_sql(intent, v)}, 0))
    rows = steps[-1]["output"]["rows"]
    if not rows or rows[0][0] is None:
        raise toolkit.ToolError("the query found no rows")
    if intent == "policy":
        docs_tool = next(name for name, t in wf.tools.items() if t.kind == "search")
        status = rows[0][0]
        if status not in POLICY:
            raise toolkit.ToolError(f"no policy for status {status!r}")
        steps += call_step(registry, guard, docs_tool, {"query": POLICY[status][1], "top_k": 1}, 2)
        hits = steps[-1]["output"]["results"]
        if not hits:
            raise toolkit.ToolError("the policy search found nothing")
        answer = f"Order {v['order']} is {status}. {hits[0]['text']}"
    else:
        answer = compose(intent, v, rows)
    messages = conversation(wf, {"input": question["question"]}, steps)
    final = {"name": "final_answer", "arguments": json.dumps({"answer": answer})}
    call_id = f"call_{steps[-1]['n'] + 1}"
    messages.append(
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": final}]}
    )
    return {"messages": messages, "answer": answer}


# --- the splits ---------------------------------------------------------------------------------------


def held_out_customers(ref: Reference, share: float, rng: random.Random) -> set[str]:
    customers = sorted({o["customer"] for o in ref.orders})
    if len(customers) < 2:
        raise ValueError("tool-data needs orders from at least two customers to hold some out")
    rng.shuffle(customers)
    return set(customers[: min(len(customers) - 1, max(1, round(share * len(customers))))])


def slot_values(orders: list[dict]) -> dict[str, list]:
    return {
        "customer": sorted({o["customer"] for o in orders}),
        "order": [o["id"] for o in orders],
        "customer_item": sorted({(o["customer"], o["item"]) for o in orders}),
    }


NAME_PIECE = re.compile(r"[a-z]{1,6}")  # a lowercase word piece a name is made of
LETTER_DEALS = 8  # a single letter is in the deck this many times: what a tokenizer falls back to between pieces
NAME_CHARS = 12  # at most, so that every intent's query fits a tool call's 64-character string
DRAWS = 20


def read_tokenizer(path: str):
    """The tokenizer and its text's sha256. `path`: a tokenizer.json, or a checkpoint (or run)
    whose tokenizer is read checked against its manifest (model/tokenizer.checkpoint_tokenizer)."""
    from tokenizers import Tokenizer

    from lmfoundry.model.tokenizer import MAX_TOKENIZER_BYTES, checkpoint_tokenizer

    uri = storage.normalize(path)
    if uri.endswith(".json"):
        if not storage.exists(uri):
            raise ValueError(f"name_pieces={path!r}: no tokenizer at {uri} (give a tokenizer.json or a checkpoint)")
        if (size := storage.size(uri) or 0) > MAX_TOKENIZER_BYTES:  # before reading it
            raise ValueError(
                f"name_pieces={path!r}: {uri} is {size:,} bytes; a tokenizer here is at most {MAX_TOKENIZER_BYTES:,}"
            )
        try:  # bounded: a file that grew since, or is not a regular file, is refused too
            text = storage.read_bytes(uri, limit=MAX_TOKENIZER_BYTES).decode("utf-8", errors="replace")
        except ValueError as e:
            raise ValueError(f"name_pieces={path!r}: {e}") from None
    else:
        try:
            text, _, _ = checkpoint_tokenizer(uri)
        except FileNotFoundError as e:
            raise ValueError(f"name_pieces={path!r}: no tokenizer: {e} (give a tokenizer.json or a checkpoint)") from e
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as e:  # a file that is not a tokenizer: the start of its parser's words, and which file
        raise ValueError(f"name_pieces={path!r}: {uri} is not a tokenizers JSON file: {str(e)[:200]}") from e
    return tokenizer, hashlib.sha256(text.encode()).hexdigest()


def word_pieces(tokenizer) -> list[str]:
    """The tokenizer's lowercase word pieces of 1 to 6 letters that it writes as one token when
    they stand alone (a byte-level BPE writes ASCII letters as themselves)."""
    pieces = [t for t in tokenizer.get_vocab() if NAME_PIECE.fullmatch(t)]
    pieces = sorted(t for t in pieces if tokenizer.encode(t, add_special_tokens=False).tokens == [t])
    if len(pieces) < 10:
        raise ValueError(
            f"name_pieces: the tokenizer has {len(pieces)} lowercase word pieces of 1-6 letters; names need 10"
        )
    return pieces


def pieces_written(tokenizer, pieces: list[str], names: set[str], answers: list[str]) -> dict:
    """How many of `pieces` the training answers write as a token of an invented name, the name
    tokenized as the model will see it."""
    written = {w for a in answers for w in re.findall(r"[a-z]+", a)} & names
    tokens = {t for name in written for t in tokenizer.encode(name, add_special_tokens=False).tokens}
    return {"pieces": len(pieces), "written_in_a_name": len(tokens & set(pieces)), "names_written": len(written)}


def piece_names(n: int, taken: set[str], rng: random.Random, pieces: list[str], tokenizer) -> list[str]:
    """n names, none of them in `taken`, each two or more of `pieces` joined (5 to NAME_CHARS
    letters) that the tokenizer splits back into those pieces. The pieces are dealt from a
    shuffled deck (a single letter LETTER_DEALS times), so that nearly every piece is in a name
    before any is in two: the pieces of a name that is taken, or that the tokenizer splits
    otherwise, go back into the deck at random places, and after DRAWS tries a name that splits
    otherwise is kept. Refused when the pieces cannot make n different names."""
    deck: list[str] = []
    names: set[str] = set()
    budget = 10 * DRAWS * max(1, n)  # tries in all
    while len(names) < n:
        for tries in range(DRAWS):
            budget -= 1
            if budget < 0:
                raise ValueError(
                    f"name_pieces: {len(pieces)} word pieces made {len(names)} different names, not the "
                    f"{n} asked for; give a tokenizer with more lowercase pieces or fewer practice_customers"
                )
            target, parts = rng.randint(5, NAME_CHARS), []
            while len(parts) < 2 or len("".join(parts)) < target:
                if not deck:
                    deck = pieces + [p for p in pieces if len(p) == 1] * (LETTER_DEALS - 1)
                    rng.shuffle(deck)
                if len(parts) >= 2 and len("".join(parts)) + len(deck[-1]) > NAME_CHARS:
                    break  # two pieces always fit: NAME_PIECE is at most half of NAME_CHARS
                parts.append(deck.pop())
            name = "".join(parts)
            fresh = name not in taken and name not in names
            if fresh and (tokenizer.encode(name, add_special_tokens=False).tokens == parts or tries == DRAWS - 1):
                names.add(name)
                break
            for part in parts:
                deck.insert(rng.randrange(len(deck) + 1), part)
    return sorted(names)


def invented_names(n: int, taken: set[str], rng: random.Random) -> list[str]:
    """n lowercase names, none of them in `taken`: half pronounceable (two or three syllables),
    half random letters, so that they break into many different tokens."""
    onsets = "b c d f g h j k l m n p r s t v w z br dr gl gr kr pl st tr".split()
    vowels, codas = "a e i o u y ai ou ee".split(), ("", "", "", "n", "r", "x", "s", "l", "ch", "ck")
    letters = "abcdefghijklmnopqrstuvwxyz"
    names: set[str] = set()
    while len(names) < n:
        if len(names) % 2:
            name = "".join(rng.choice(letters) for _ in range(rng.randint(4, 8)))
        else:
            syllables = (rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(2, 3)))
            name = "".join(syllables) + rng.choice(codas)
        if name not in taken:
            names.add(name)
    return sorted(names)


def write_practice_db(
    path: str,
    ref: Reference,
    held: set[str],
    customers: int,
    rng: random.Random,
    pieces: list[str] | None = None,
    tokenizer=None,
) -> set[str]:
    """The real database's training rows plus `customers` invented customers with one to five
    orders each: items and statuses from the real rows, totals in their range (in quarters), ids
    no real order has. Their names are made of `pieces` when given (piece_names); returns them."""
    kept = [o for o in ref.orders if o["customer"] not in held]
    items = sorted({o["item"] for o in ref.orders})
    statuses = [o["status"] for o in ref.orders]  # drawn as often as they occur
    low, high = min(o["total"] for o in ref.orders), max(o["total"] for o in ref.orders)
    taken = ref.vocabulary() | {w for o in ref.orders for w in re.findall(r"\w+", str(o["customer"]).lower())}
    real_ids = {o["id"] for o in ref.orders}
    next_id = iter(i for i in range(1, 10**9) if i not in real_ids)
    invented = []
    names = invented_names(customers - customers // 2 if pieces else customers, taken, rng)
    if pieces:  # half of them: a common piece is in many pronounceable or random names, a rare one in none
        names += piece_names(customers // 2, taken | set(names), rng, pieces, tokenizer)
    for name in names:
        for item in rng.sample(items, rng.randint(1, min(5, len(items)))):
            total = round(rng.uniform(low, high) * 4) / 4
            invented.append({"customer": name, "item": item, "total": total, "status": rng.choice(statuses)})
    ids = [next(next_id) for _ in invented]
    rng.shuffle(ids)  # a customer's orders are not numbered in a row
    invented = [{"id": i, **o} for o, i in zip(invented, ids, strict=True)]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT, item TEXT, total REAL, status TEXT)")
        conn.executemany(
            "INSERT INTO orders (id, customer, item, total, status) VALUES (:id, :customer, :item, :total, :status)",
            kept + invented,
        )
        conn.commit()
    return set(names)


def on_database(wf: WorkflowConfig, dsn: str) -> WorkflowConfig:
    """The workflow with its sql tool on another database."""
    tools = {n: t.model_copy(update={"dsn": dsn}) if t.kind == "sql" else t for n, t in wf.tools.items()}
    return wf.model_copy(update={"tools": tools})


def words(template: str) -> set[str]:
    return set(re.findall(r"[a-z']+", re.sub(r"\{\w+\}", " ", template.lower())))


def close_to(template: str, others: list[str]) -> bool:
    """True when `template` and another share half their words or more (Jaccard), or when 80% of
    the shorter one's words are in the longer (a phrasing that opens another, or asks a part of it)."""
    mine = words(template)
    for other in map(words, others):
        shared = len(mine & other)
        if shared >= 0.5 * len(mine | other) or shared >= 0.8 * min(len(mine), len(other)):
            return True
    return False


def split_phrasings(held: int, rng: random.Random, variants: bool = False) -> dict[str, dict[str, list[str]]]:
    """The test split's phrasings (`held` of PHRASINGS' per intent) and the training split's: the
    rest, plus (with `variants`) every VARIANTS phrasing not close to a held-out one."""
    out: dict[str, dict[str, list[str]]] = {"train": {}, "test": {}}
    for intent, phrasings in PHRASINGS.items():
        if held >= len(phrasings):
            raise ValueError(f"test_phrasings={held}: intent {intent!r} has only {len(phrasings)} phrasings")
        order = list(phrasings)
        rng.shuffle(order)
        out["test"][intent], out["train"][intent] = order[:held], order[held:]
    if variants:
        every_test = [t for ts in out["test"].values() for t in ts]
        for intent, extra in VARIANTS.items():
            out["train"][intent] += [t for t in extra if not close_to(t, every_test)]
    return out


def reworded(template: str, rng: random.Random) -> str:
    """The template as a user might type it: an opener or closer, lower case, no final mark. The
    template, not the question: a value (a name with capitals, "Inc.") is asked as it is stored."""
    if rng.random() < 0.25:
        template = rng.choice(OPENERS) + template[0].lower() + template[1:]
    if rng.random() < 0.2:
        template += rng.choice(CLOSERS)
    if rng.random() < 0.2:
        template = template.lower()  # the slots' names are lower case already
    if rng.random() < 0.2:
        template = template.rstrip("?.!")
    return template


def questions(
    phrasings: dict[str, list[str]], values: dict[str, list], size: int, rng: random.Random, reword: bool = False
) -> list[dict]:
    """Every (phrasing, values) of every intent, taken round-robin over the intents up to `size`,
    so that each intent is as common as its combinations allow (`reword`: each question as
    `reworded` gives it).

    The order spreads the subjects (a question's customer, or its order): within an intent, every
    subject is asked about once before any is asked twice, and the intents that ask about the same
    kind of subject start at evenly spaced places of one shuffled list of them, so that together
    their first questions name as many different subjects as they are questions."""
    subjects = {kind: list(values.get(kind, [])) for kind in ("customer", "order")}
    for kind in subjects:
        rng.shuffle(subjects[kind])
    place = {kind: {s: i for i, s in enumerate(ordered)} for kind, ordered in subjects.items()}
    sharing = Counter(SLOTS[intent][0] for intent in phrasings)
    started = Counter()
    per_intent = []
    for intent, templates in phrasings.items():
        slots = SLOTS[intent]
        kind = slots[0]  # the subject: customer or order
        if slots == ("customer", "item"):
            fills = [{"customer": c, "item": i} for c, i in values["customer_item"]]
        else:
            fills = [{kind: x} for x in values[kind]]
        combos = [
            {"intent": intent, "template": t, "values": f, "question": t.format(**f)} for t in templates for f in fills
        ]
        rng.shuffle(combos)
        n = max(1, len(subjects[kind]))
        offset = started[kind] * n // sharing[kind]
        started[kind] += 1
        times, keys = Counter(), []
        for c in combos:
            subject = c["values"][kind]
            keys.append((times[subject], (place[kind][subject] - offset) % n))
            times[subject] += 1
        combos = [c for _, c in sorted(zip(keys, combos), key=lambda kc: kc[0])]
        if reword:
            for c in combos:
                c["question"] = reworded(c["template"], rng).format(**c["values"])
        per_intent.append(combos)
    out = []
    for k in range(max(map(len, per_intent), default=0)):
        out += [combos[k] for combos in per_intent if k < len(combos)]
    return out[:size]


def run_tool_data(cfg: ToolDataConfig) -> dict:
    workflows = load_workflows(cfg.workflows)
    if cfg.workflow not in workflows:
        raise ValueError(f"workflow {cfg.workflow!r} is not in {cfg.workflows}; there: {sorted(workflows)}")
    wf = workflows[cfg.workflow]
    kinds = Counter(t.kind for t in wf.tools.values())
    if kinds["sql"] != 1 or kinds["search"] != 1:
        raise ValueError(f"workflow {wf.name}: tool-data needs exactly one sql and one search tool, not {dict(kinds)}")
    if wf.first_tool is not None and wf.tools[wf.first_tool].kind != "sql":
        raise ValueError(f"workflow {wf.name}: first_tool {wf.first_tool!r}: every conversation here starts with sql")
    if wf.max_steps < 3:
        raise ValueError(f"workflow {wf.name}: max_steps={wf.max_steps}; policy questions take 3 model steps")
    tokenizer, pieces = None, None
    if cfg.name_pieces:
        tokenizer, tokenizer_sha256 = read_tokenizer(cfg.name_pieces)
        pieces = word_pieces(tokenizer)
    out = storage.normalize(cfg.output)
    ref = Reference.read(wf)
    if not storage.prepare_output(out, cfg.overwrite):
        logger.info("tool-data: %s is already committed; skipping (set overwrite=true to redo)", out)
        return storage.read_json(storage.join(out, "card.json"))
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="lmfoundry-tool-data-") as scratch:
        rng = random.Random(cfg.seed)
        held, phrasings = (
            held_out_customers(ref, cfg.test_share, rng),
            split_phrasings(cfg.test_phrasings, rng, cfg.variants),
        )
        train_wf = wf
        if cfg.practice_customers:
            practice = os.path.join(scratch, "practice.sqlite")
            invented = write_practice_db(practice, ref, held, cfg.practice_customers, rng, pieces, tokenizer)
            storage.upload_file(practice, storage.join(out, "practice.sqlite"))
            train_wf = on_database(wf, practice)
        registries = {"train": build_registry(train_wf), "test": build_registry(wf)}
        # the tools as the worker offers them (the same definitions on either database)
        tools = registries["test"].specs(list(wf.tools)) + [final_answer_spec(wf.max_answer_chars)]
        guard = Guard(wf.secret_envs())
        counts, rejected, asked = {}, [], []
        for split, size, split_wf in (("train", cfg.train_size, train_wf), ("test", cfg.test_size, wf)):
            registry = registries[split]
            split_ref = ref if split_wf is wf else Reference.read(split_wf)
            orders = [o for o in split_ref.orders if (o["customer"] in held) == (split == "test")]
            values = slot_values(orders)
            kept = []
            for q in questions(phrasings[split], values, size, rng, cfg.variants and split == "train"):
                try:
                    made = teach(split_wf, registry, guard, q)
                    reason = verify_answer(q["intent"], q["values"], made["answer"], split_ref)
                except toolkit.ToolError as e:
                    made, reason = None, str(e)
                if reason is None and len(made["answer"]) > wf.max_answer_chars:
                    reason = f"the answer is longer than the workflow's max_answer_chars={wf.max_answer_chars}"
                if reason is not None:
                    rejected.append({"split": split, **q, "reason": reason})
                    continue
                kept.append({"messages": made["messages"], "tools": tools})
                asked.append({"split": split, **q, "answer": made["answer"]})
            storage.write_jsonl_atomic(storage.join(out, f"{split}.jsonl"), kept)
            counts[split] = {
                "conversations": len(kept),
                "by_intent": dict(sorted(Counter(q["intent"] for q in asked if q["split"] == split).items())),
                "phrasings": sum(map(len, phrasings[split].values())),
                "customers": len(values["customer"]),
                "orders": len(values["order"]),
            }
    if pieces:
        name_pieces = {
            "tokenizer_sha256": tokenizer_sha256,
            **pieces_written(tokenizer, pieces, invented, [q["answer"] for q in asked if q["split"] == "train"]),
        }
        logger.info(
            "tool-data: %(written_in_a_name)d of %(pieces)d word pieces written in a training name", name_pieces
        )
    storage.write_jsonl_atomic(storage.join(out, "questions.jsonl"), asked)
    storage.write_jsonl_atomic(storage.join(out, "rejected.jsonl"), rejected)
    card = {
        "workflow": wf.name,
        "teacher": "rule-based (templates; tools run for real; answers verified against the database)",
        "counts": counts,
        "rejected": len(rejected),
        **({"name_pieces": name_pieces} if pieces else {}),
        "seconds": round(time.time() - started, 2),
    }
    storage.write_json_atomic(storage.join(out, "card.json"), card)
    parts = ["train.jsonl", "test.jsonl", "questions.jsonl", "rejected.jsonl"]
    fingerprint = storage.fingerprint(out, parts + (["practice.sqlite"] if cfg.practice_customers else []))
    storage.commit(out, "tool-data", {"card": "card.json", "counts": counts, "fingerprint": fingerprint})
    logger.info("tool-data: %s, %d rejected", counts, len(rejected))
    return {**card, "fingerprint": fingerprint}
