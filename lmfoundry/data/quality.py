"""A model-based quality score: a linear classifier that tells high-quality reference text from
random web-like text, trained the way GPT-3 (Brown et al. 2020, appendix A) and DCLM (Li et al.
2024) trained theirs, on one of two feature sets:

- `hashed`: word 1- and 2-grams hashed into 2^20 buckets (scikit-learn's HashingVectorizer, the
  features of GPT-3's classifier and of fastText's), fast on CPU;
- `embedding`: all-MiniLM-L6-v2 sentence embeddings (uses a GPU when the worker has one).

The model is saved as `quality_model.json` (settings, metrics) plus `quality_model.npz` (weights):
no pickle, so loading a model file cannot run code.
"""

from __future__ import annotations

import json
import time
from typing import Literal

import numpy as np
from pydantic import Field

from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)

HASH_FEATURES = 1 << 20


class QualityConfig(StageConfig):
    """The curation stage's use of a trained model."""

    model: str | None = Field(None, description="directory written by `lmfoundry quality-model`")
    threshold: float = Field(0.5, ge=0, le=1, description="documents scoring below are dropped")


class QualityTrainConfig(StageConfig):
    positive: str = Field(..., description="high-quality reference text: jsonl(.gz)/parquet/txt file or folder")
    negative: str = Field(..., description="random web-like text, same formats")
    output: str
    text_field: str = "text"
    features: Literal["hashed", "embedding"] = "hashed"
    max_documents: int = Field(50_000, ge=10, description="per class")
    validation_fraction: float = Field(0.2, gt=0, lt=1)
    regularization: float = Field(1.0, gt=0, description="inverse L2 strength (scikit-learn's C)")
    seed: int = 0
    overwrite: bool = False


def _hasher():
    from sklearn.feature_extraction.text import HashingVectorizer

    return HashingVectorizer(
        n_features=HASH_FEATURES,
        ngram_range=(1, 2),
        alternate_sign=False,
        norm="l2",
        lowercase=True,
        token_pattern=r"(?u)\b\w+\b",
    )


class QualityModel:
    """Scores texts in [0, 1]: the classifier's probability that a text is reference-like."""

    def __init__(self, features: str, coef: np.ndarray, intercept: float, info: dict | None = None):
        self.features, self.coef, self.intercept, self.info = (
            features,
            coef.astype(np.float32),
            float(intercept),
            info or {},
        )
        self._featurize = None

    def featurize(self, texts: list[str]):
        if self._featurize is None:
            if self.features == "hashed":
                self._featurize = _hasher().transform
            else:
                from lmfoundry.data.embed import Embedder

                self._featurize = Embedder()
        return self._featurize(texts)

    def __call__(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0, dtype=np.float32)
        logits = self.featurize(texts) @ self.coef + self.intercept
        return (1.0 / (1.0 + np.exp(-np.asarray(logits).ravel()))).astype(np.float32)

    def save(self, out: str) -> None:
        import io

        buf = io.BytesIO()
        np.savez_compressed(buf, coef=self.coef)
        storage.write_bytes_atomic(storage.join(out, "quality_model.npz"), buf.getvalue())
        storage.write_json_atomic(
            storage.join(out, "quality_model.json"),
            {"features": self.features, "intercept": self.intercept, **self.info},
        )

    @classmethod
    def load(cls, path: str) -> QualityModel:
        meta_uri = storage.join(path, "quality_model.json")
        if not storage.exists(meta_uri):
            raise FileNotFoundError(f"{path} holds no quality_model.json; train one with `lmfoundry quality-model`")
        meta = storage.read_json(meta_uri)
        import io

        coef = np.load(io.BytesIO(storage.read_bytes(storage.join(path, "quality_model.npz"))))["coef"]
        return cls(meta["features"], coef, meta["intercept"], meta)


def read_texts(uri: str, text_field: str, limit: int) -> list[str]:
    """Texts from a jsonl(.gz) / parquet / txt file or folder (a .txt file is one document)."""
    import pyarrow.parquet as pq

    files = storage.list_files(uri, (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet", ".txt"))
    if not files:
        raise FileNotFoundError(f"{uri} holds no .jsonl, .jsonl.gz, .parquet or .txt files")
    texts: list[str] = []
    for f in files:
        data = storage.read_bytes(f)
        if f.endswith(".parquet"):
            import io

            texts += [t for t in pq.read_table(io.BytesIO(data), columns=[text_field]).column(0).to_pylist() if t]
        elif f.endswith(".txt"):
            texts.append(data.decode("utf-8"))
        else:
            for line in data.decode("utf-8").splitlines():
                if line.strip():
                    row = json.loads(line)
                    if text_field not in row:
                        raise ValueError(f"{f}: a row has no field {text_field!r}; its fields are {sorted(row)}")
                    texts.append(row[text_field])
        if len(texts) >= limit:
            break
    return texts[:limit]


def train_quality_model(cfg: QualityTrainConfig) -> dict:
    """Fits the classifier, reports held-out accuracy and AUC, and writes the model to cfg.output."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    out = storage.normalize(cfg.output)
    if storage.exists(storage.join(out, "quality_model.json")) and not cfg.overwrite:
        raise FileExistsError(f"{out} already holds a quality model; set overwrite=true to replace it")
    started = time.time()
    pos = read_texts(cfg.positive, cfg.text_field, cfg.max_documents)
    neg = read_texts(cfg.negative, cfg.text_field, cfg.max_documents)
    if min(len(pos), len(neg)) < 5:
        raise ValueError(f"need at least 5 documents per class; got {len(pos)} positive, {len(neg)} negative")
    texts = pos + neg
    labels = np.array([1] * len(pos) + [0] * len(neg))
    order = np.random.default_rng(cfg.seed).permutation(len(texts))
    n_val = max(2, int(len(texts) * cfg.validation_fraction))
    val, train = order[:n_val], order[n_val:]
    model = QualityModel(cfg.features, np.zeros(1), 0.0)
    feats = model.featurize(texts)
    clf = LogisticRegression(C=cfg.regularization, max_iter=1000, class_weight="balanced")
    clf.fit(feats[train], labels[train])
    model.coef, model.intercept = clf.coef_.ravel().astype(np.float32), float(clf.intercept_[0])
    scores = 1 / (1 + np.exp(-(np.asarray(feats[val] @ model.coef).ravel() + model.intercept)))
    metrics = {
        "validation_accuracy": float(((scores >= 0.5) == labels[val]).mean()),
        "validation_auc": float(roc_auc_score(labels[val], scores)) if len(set(labels[val])) == 2 else None,
        "positive_documents": len(pos),
        "negative_documents": len(neg),
        "seconds": round(time.time() - started, 2),
    }
    model.info = {"features": cfg.features, "positive": cfg.positive, "negative": cfg.negative, **metrics}
    model.save(out)
    logger.info(
        "quality model (%s features): validation accuracy %.3f, AUC %s -> %s",
        cfg.features,
        metrics["validation_accuracy"],
        metrics["validation_auc"],
        out,
    )
    return metrics
