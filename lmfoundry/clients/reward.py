"""A reward model checkpoint (train/reward.py) as a scorer, in process: an outcome model rates
whole solutions, a process model rates each step. The encoding here is the one training used:
the prompt, then each step followed by the step delimiter (or the reply and the end-of-sequence
token), so a score is read where the model learned to put it."""

from __future__ import annotations

import torch

STEP_DELIMITER = "\n"


def encode_steps(encode, prompt: str, steps: list[str], max_len: int, eos: int) -> tuple[list[int], list[int]]:
    """The ids of prompt and steps, and the position of each step's last token. The prompt is cut
    from the left to half the context; steps that do not fit after it are left out."""
    ids = list(encode(prompt)[-(max_len // 2) :] or [eos])
    positions = []
    for step in steps:
        piece = encode(step + STEP_DELIMITER)
        if len(ids) + len(piece) > max_len:
            break
        ids += piece
        positions.append(len(ids) - 1)
    return ids, positions


def encode_reply(encode, prompt: str, reply: str, max_len: int, eos: int) -> list[int]:
    """Prompt, reply and the end-of-sequence token, whose position holds the score."""
    ids = (encode(prompt)[-(max_len // 2) :] or [eos]) + encode(reply)
    return ids[: max_len - 1] + [eos]


class RewardScorer:
    """Scores from a reward model checkpoint (one with `reward_head`)."""

    def __init__(self, checkpoint_dir: str, device: str = "cpu", batch_size: int = 16):
        from tokenizers import Tokenizer

        from lmfoundry.model.checkpoint import TOKENIZER, load_model_files
        from lmfoundry.model.tokenizer import SpecialTokens

        self.model = load_model_files(checkpoint_dir, device).eval()
        if not self.model.cfg.reward_head:
            raise ValueError(f"{checkpoint_dir} is not a reward model (its model config has no reward_head)")
        self.tokenizer = Tokenizer.from_file(f"{checkpoint_dir}/{TOKENIZER}")
        self.eos = SpecialTokens.of_checkpoint(checkpoint_dir).eos_id(self.tokenizer)
        self.max_len = self.model.cfg.max_seq_len
        self.device, self.batch_size = device, batch_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @torch.no_grad()
    def _at(self, rows: list[tuple[list[int], int]]) -> list[float]:
        """The score at one position of each row."""
        out = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            ids = torch.full((len(chunk), max(len(r) for r, _ in chunk)), self.eos, dtype=torch.long)
            for i, (r, _) in enumerate(chunk):
                ids[i, : len(r)] = torch.tensor(r)
            scores, _ = self.model(ids.to(self.device))
            out += [float(scores[i, p, 0]) for i, (_, p) in enumerate(chunk)]
        return out

    def score(self, prompt: str, solutions: list[str]) -> list[float]:
        rows = [encode_reply(self.encode, prompt, s, self.max_len, self.eos) for s in solutions]
        return self._at([(r, len(r) - 1) for r in rows])

    def score_steps(self, prompt: str, partials: list[list[str]]) -> list[float]:
        """The score after the last step of each partial solution (-inf when none fits)."""
        rows, which = [], []
        for i, steps in enumerate(partials):
            ids, positions = encode_steps(self.encode, prompt, steps, self.max_len, self.eos)
            if len(positions) == len(steps) and positions:
                rows.append((ids, positions[-1]))
                which.append(i)
        scores = [float("-inf")] * len(partials)
        for i, value in zip(which, self._at(rows)):
            scores[i] = value
        return scores
