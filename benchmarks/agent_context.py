"""How much context a model needs to run the orders agent workflow: the tool-use conversations
(agents/tool_data.py, as configs/tool_data.yaml makes them) rendered with the chat template and
counted in the quickstart's tokens.

    python benchmarks/agent_context.py

The tokenizer is the quickstart's: byte-level BPE of 4,096 tokens (configs/quickstart.yaml,
pack.vocab_size) trained on the quickstart's sample corpus (its 1,500 standard-library
documents). For each conversation: the prompt of every model step as the serving API renders it
for the worker's request (tool_choice required: system prompt, the three tools' definitions,
the turns so far, the opened tool call), and the reply the model must write at that step. A step
fits when prompt + the workflow's max_tokens fit the context (serving refuses it otherwise, with a
400, before it generates).

Then the tool-call grammars the server compiles for the workflow (serving/grammar.py, with the
same tokenizer): the first step's (the forced `sql` call) and a middle step's (any of the three
tools, tool_choice required), by the transitions of their automata, against the server's limit.
Writes benchmarks/results/agent_context.json.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from lmfoundry.agents.tool_data import ToolDataConfig, run_tool_data
from lmfoundry.agents.workflow import load_workflows
from lmfoundry.data.sample_corpus import stdlib_documents
from lmfoundry.data.tokenizer import train_bpe
from lmfoundry.jobs.agents import demo_data
from lmfoundry.model.chat_template import ChatTemplate

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART_CONTEXT = 128  # configs/quickstart.yaml, pack.seq_len: the quickstart model's context
CONTEXTS = (128, 256, 512, 768, 1024, 2048)


def steps(row: dict, template: ChatTemplate) -> list[tuple[str, str]]:
    """(prompt, reply) of each model step of a conversation, as the model sees and writes them."""
    whole = template.render(row["messages"], row["tools"])
    out = []
    for k, m in enumerate(row["messages"]):
        if m["role"] == "assistant":
            prompt = template.render(row["messages"][:k], row["tools"], force_tool_call=True)
            out.append((prompt, whole[len(prompt) :].split("</tool_call>")[0] + "</tool_call>"))
    return out


def grammar_sizes(tok, tools: list[dict]) -> dict:
    """Transitions of the automata the server would build for the workflow's tool calls (the
    limit lifted here, to measure them) and the limit the server holds them to."""
    from lmfoundry.serving import grammar

    limit = grammar.MAX_TRANSITIONS
    grammar.MAX_TRANSITIONS = 1 << 62
    try:
        compiled = grammar.Grammars(tok, tok.token_to_id("<|endoftext|>"))
        functions = [t["function"] for t in tools]
        sizes = {}
        for step, name in (("first_step_sql", "sql"), ("middle_step_any_tool", None)):
            index, _ = compiled._index(grammar.tool_call_schema(functions, name))  # as the server compiles it
            sizes[step] = sum(len(t) for t in index.get_transitions().values())
    finally:
        grammar.MAX_TRANSITIONS = limit
    return {**sizes, "server_limit": limit}


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="agent-context-"))
    made = demo_data(str(work / "agents"))
    spec = yaml.safe_load((ROOT / "configs/workflows/orders.yaml").read_text())
    wf_spec = spec["workflows"]["orders_and_docs"]
    wf_spec["tools"]["sql"]["dsn"], wf_spec["tools"]["docs"]["corpus"] = made["orders"], made["docs"]
    (work / "orders.yaml").write_text(yaml.safe_dump({"workflows": {"orders_and_docs": wf_spec}}, sort_keys=False))
    wf = load_workflows(str(work / "orders.yaml"))["orders_and_docs"]
    # the conversations the agent's model trains and is tested on: configs/tool_data.yaml's
    shipped = yaml.safe_load((ROOT / "configs/tool_data.yaml").read_text())
    run_tool_data(ToolDataConfig(**{**shipped, "workflows": str(work / "orders.yaml"), "output": str(work / "data")}))
    rows = [json.loads(x) for s in ("train", "test") for x in (work / "data" / f"{s}.jsonl").read_text().splitlines()]

    tok = train_bpe(stdlib_documents(1500), vocab_size=4096)
    template = ChatTemplate()

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    prompts, replies, needed = [], [], []
    for row in rows:
        measured = [(count(p), count(r)) for p, r in steps(row, template)]
        prompts += [p for p, _ in measured]
        replies += [r for _, r in measured]
        needed.append(max(p for p, _ in measured) + wf.max_tokens)
    first_prompt = count(template.render(rows[0]["messages"][:2], rows[0]["tools"], force_tool_call=True))
    tools_only = count(template.render(rows[0]["messages"][:1], rows[0]["tools"]))
    whole = [count(template.render(r["messages"], r["tools"])) for r in rows]
    longest_reply = max(replies)
    grammars = grammar_sizes(tok, rows[0]["tools"])
    result = {
        "benchmark": "agent_context",
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/agent_context.py",
        "load_average_1m": round(os.getloadavg()[0], 2),
        "tokenizer": "byte-level BPE, 4,096 tokens, on the quickstart's 1,500 sample documents",
        "conversations": len(rows),
        "workflow_max_tokens": wf.max_tokens,
        "tokens": {
            "system_prompt_and_tool_definitions": tools_only,
            "first_step_prompt": first_prompt,
            "step_prompt_median": statistics.median(prompts),
            "step_prompt_max": max(prompts),
            "reply_median": statistics.median(replies),
            "reply_max": longest_reply,
            "conversation_median": statistics.median(whole),
            "conversation_max": max(whole),
        },
        "context_needed": {
            "with_workflow_max_tokens": max(needed),
            "with_max_tokens_of_longest_reply_plus_32": max(prompts) + longest_reply + 32,
        },
        "share_of_conversations_that_fit": {
            str(c): round(sum(n <= c for n in needed) / len(needed), 3) for c in CONTEXTS
        },
        "quickstart_context": QUICKSTART_CONTEXT,
        "tool_call_grammar_transitions": grammars,
    }
    out = ROOT / "benchmarks" / "results" / "agent_context.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'tokens':<40} {'value':>8}")
    for key, value in {**result["tokens"], **result["context_needed"]}.items():
        print(f"{key:<40} {value:>8}")
    print(f"{'context':<10} share of conversations whose every step fits (max_tokens={wf.max_tokens})")
    for c, share in result["share_of_conversations_that_fit"].items():
        print(f"{c:<10} {share:.3f}")
    for step, n in grammars.items():
        print(f"grammar transitions, {step:<28} {n:>10}")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
