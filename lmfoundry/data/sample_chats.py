"""Small synthetic conversations for supervised fine-tuning: arithmetic, comparisons, echoes and a
tool call with its result, across system, developer, user, assistant and tool turns. For the SFT
tests, the benchmark and the quickstart; a real run brings its own data.

    python -m lmfoundry.data.sample_chats work/chats.jsonl --conversations 512
"""

import argparse
import json
import random
import sys

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Hanoi"]


def conversation(rng: random.Random, i: int) -> dict:
    a, b = rng.randint(1, 40), rng.randint(1, 40)
    kind = i % 4
    if kind == 0:
        return {
            "messages": [
                {"role": "user", "content": f"What is {a} + {b}?"},
                {"role": "assistant", "content": f"{a + b}."},
            ]
        }
    if kind == 1:
        return {
            "messages": [
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": f"Is {a} larger than {b}?"},
                {"role": "assistant", "content": "Yes." if a > b else "No."},
                {"role": "user", "content": f"And {b} + 1?"},
                {"role": "assistant", "content": f"{b + 1}."},
            ]
        }
    if kind == 2:
        city = rng.choice(CITIES)
        return {
            "messages": [
                {"role": "developer", "content": "Use the tools."},
                {"role": "user", "content": f"Weather in {city}?"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
                        }
                    ],
                },
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": f"It is sunny in {city}."},
            ],
            "tools": [WEATHER],
        }
    return {
        "messages": [{"role": "user", "content": f"Repeat {a} twice."}, {"role": "assistant", "content": f"{a} {a}"}]
    }


def write_chats(path, n: int = 64, seed: int = 0, extra: list[dict] = ()) -> str:
    """n conversations (and `extra` ones after them) as JSON lines at `path`; returns the path."""
    rng = random.Random(seed)
    rows = [conversation(rng, i) for i in range(n)] + list(extra)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmfoundry.data.sample_chats", description=__doc__)
    p.add_argument("output", help="the JSONL file to write")
    p.add_argument("--conversations", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.conversations < 1:
        p.error("--conversations must be at least 1")
    from pathlib import Path

    print(write_chats(Path(args.output), args.conversations, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
