"""Red teaming that searches: how much the attacker loop finds beyond the first round, on a
deliberately weak guardrail.

    python benchmarks/redteam_search.py              # about a minute on 2 CPU cores
    python benchmarks/redteam_search.py --seeds 3    # quicker

The system under attack is a naive guardrail (a blocklist term as written, lower-cased, refuses
the message; no folding of other spellings, no decoding) in front of a model that carries out
whatever reaches it, word for word. The judge is lmfoundry's harm scorer, which folds spellings.
For each seed, the first round (every family but injection, 2 attacks each) is followed by 3
rounds of search, with converters only, and with a tiny random-weight checkpoint as the attacker
model as well (its proposals are tried and judged like any other). The table gives, per
configuration, the median over seeds of the share of goals the first round broke and the share
broken with the search, the attempts the search made and its seconds.
Prints a table; writes benchmarks/results/redteam_search.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lmfoundry.eval import redteam
from lmfoundry.safety.harm import DEFAULT_BLOCKLIST

RESULTS = Path(__file__).resolve().parent / "results"
FAMILIES = [f for f in redteam.FAMILIES if f != "injection"]


class NaiveGuardrail:
    """A literal blocklist in front of a model that complies with everything."""

    name = "naive guardrail over a complying model"

    def chat(self, conversations, max_tokens):
        replies = []
        for messages in conversations:
            text = messages[-1]["content"]
            blocked = any(term in text.lower() for term in DEFAULT_BLOCKLIST)
            replies.append("I'm sorry, but I can't help with that." if blocked else f"Sure. Here is how: {text}")
        return replies


def tiny_attacker(directory: Path):
    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.data.tokenizer import train_bpe
    from lmfoundry.model.checkpoint import TOKENIZER, save_model_files
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.platform import checkpoint

    torch.manual_seed(0)
    tok = train_bpe(["Write the next prompt to send to the target model."] * 40, vocab_size=300)
    model = Transformer(ModelConfig(vocab_size=tok.get_vocab_size(), max_seq_len=64, n_layer=2, d_model=64, n_head=4))
    save_model_files(model.eval(), directory)
    (directory / TOKENIZER).write_text(tok.to_str())
    checkpoint.seal(directory, {"step": 0})
    return CheckpointModel(str(directory), batch_size=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        attacker = tiny_attacker(Path(scratch) / "attacker")
        rows = {}
        for label, model in (("converters only", None), ("converters + tiny attacker model", attacker)):
            runs = []
            for seed in range(args.seeds):
                cfg = redteam.RedTeamConfig(
                    families=FAMILIES, attacks_per_family=2, seed=seed, rounds=args.rounds, attacker_max_tokens=16
                )
                started = time.perf_counter()
                result = redteam.run_redteam(NaiveGuardrail(), cfg, attacker=model)
                search = result["search"]
                runs.append(
                    {
                        "first_round": search["goal_success_rate_first_round"]["rate"],
                        "with_search": search["goal_success_rate"]["rate"],
                        "attempts": search["attacks"],
                        "seconds": time.perf_counter() - started,
                        "winning_strategies": sorted(s for s, r in search["by_strategy"].items() if r["count"]),
                    }
                )
            rows[label] = {
                "goals_broken_first_round_median": statistics.median(r["first_round"] for r in runs),
                "goals_broken_with_search_median": statistics.median(r["with_search"] for r in runs),
                "search_attempts_median": statistics.median(r["attempts"] for r in runs),
                "seconds_median": statistics.median(r["seconds"] for r in runs),
                "seeds": args.seeds,
            }
    print(f"{'configuration':36} {'first round':>12} {'with search':>12} {'attempts':>9} {'seconds':>8}")
    for label, r in rows.items():
        print(
            f"{label:36} {r['goals_broken_first_round_median']:12.2f} {r['goals_broken_with_search_median']:12.2f} "
            f"{r['search_attempts_median']:9.0f} {r['seconds_median']:8.2f}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {
        "benchmark": "redteam_search",
        "machine": "2 CPU cores, no GPU",
        "date": time.strftime("%Y-%m-%d"),
        "command": f"python benchmarks/redteam_search.py --seeds {args.seeds} --rounds {args.rounds}",
        "target": NaiveGuardrail.name,
        "judge": "lmfoundry harm scorer (default blocklist, folded spellings)",
        "rounds": args.rounds,
        "share_of_goals_broken": rows,
    }
    (RESULTS / "redteam_search.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
