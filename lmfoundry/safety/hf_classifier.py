"""A local Hugging Face sequence classifier as a harm scorer, read through the activation its head
was trained with.

A multi-label head (`config.problem_type == "multi_label_classification"`, e.g. toxicity models
with toxic / insult / threat / ... labels) was trained with one sigmoid per label: the labels are
not exclusive, and a softmax across them would make a text that is both toxic and insulting look
less toxic than one that is only toxic. Its harm score is the largest sigmoid among the harmful
labels (the strongest single finding; a product of complements would assume the labels
independent, which they are not). A single-label head (softmax, exclusive classes) scores the
summed softmax of its harmful classes. A one-logit head is a binary classifier: sigmoid.
"""

from __future__ import annotations

from typing import Literal

HeadActivation = Literal["auto", "sigmoid", "softmax"]


def head_activation(problem_type: str | None, num_labels: int, override: HeadActivation = "auto") -> str:
    """'sigmoid' or 'softmax' for a head, from its config (or the operator's override)."""
    if override != "auto":
        return override
    if problem_type == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    if problem_type in (None, "single_label_classification"):
        return "softmax"
    raise ValueError(
        f"harm model head has problem_type {problem_type!r}: its outputs are not class probabilities; "
        "allowed: multi_label_classification, single_label_classification (or set harm.model_activation)"
    )


def harm_probability(logits, harm_ids: list[int], activation: str):
    """(batch, labels) logits -> (batch,) harm scores in [0, 1] (a torch tensor)."""
    if activation == "sigmoid":
        return logits.float().sigmoid()[:, harm_ids].max(-1).values
    return logits.float().softmax(-1)[:, harm_ids].sum(-1).clamp(0, 1)


class HFClassifier:
    """`__call__(texts)` -> harm scores from a local sequence-classification model directory."""

    def __init__(
        self, path: str, harmful_labels: list[str], max_tokens: int = 512, activation: HeadActivation = "auto"
    ):
        try:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as e:
            raise ImportError("harm.model needs transformers: pip install 'lmfoundry[curation-models]'") from e

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        labels = self.model.config.id2label
        self.harm_ids = [i for i, name in labels.items() if name in harmful_labels]
        if not self.harm_ids:
            raise ValueError(
                f"harm model {path} has labels {list(labels.values())}; none is in harmful_labels {harmful_labels}"
            )
        self.activation = head_activation(self.model.config.problem_type, self.model.config.num_labels, activation)
        self.max_tokens = max_tokens
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device)

    def __call__(self, texts: list[str]) -> list[float]:
        if not texts:
            return []
        import torch

        enc = self.tokenizer(
            list(texts), truncation=True, max_length=self.max_tokens, padding=True, return_tensors="pt"
        ).to(self.device)
        with torch.no_grad():
            logits = self.model(**enc).logits
        return harm_probability(logits, self.harm_ids, self.activation).tolist()
