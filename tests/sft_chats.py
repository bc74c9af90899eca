"""Small conversations for the SFT tests and benchmark: every role, tools and tool calls."""

import json
import random

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
    rng = random.Random(seed)
    rows = [conversation(rng, i) for i in range(n)] + list(extra)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
