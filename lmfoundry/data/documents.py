"""Per-document curation: every stage that judges a document on its own, in order, on one batch.

normalise -> language -> heuristic rules (C4, Gopher, FineWeb) -> PII redaction -> harm ->
quality -> knowledge density -> exact-dedup hash and MinHash signature.

A document rejected at one stage skips the later judging stages (its scores stay null), but is
still normalised and redacted: rejected/ must not hold PII either. `DocumentProcessor` is a plain
class, so it runs and is tested without Ray; the curation pipeline calls it in Ray Data workers.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import xxhash

from lmfoundry.data.dedup import MinHasher
from lmfoundry.data.density import knowledge_density
from lmfoundry.data.filters import HeuristicFilter
from lmfoundry.data.langid import UNKNOWN, LanguageIdentifier
from lmfoundry.data.normalize import normalize_text
from lmfoundry.data.quality import QualityModel
from lmfoundry.safety.harm import HarmScorer
from lmfoundry.safety.pii import PIIRedactor

KEPT = ""  # the `reason` of a kept document
SHARD_BITS = 32  # doc_key = shard index << 32 | row in shard: unique, ordered like the input


def text_hash(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def derive_id(path: str, row: int, text: object) -> str:
    """A stable id for a document whose input has none: its file, its row and a content hash."""
    return f"{path.rsplit('/', 1)[-1]}:{row}:{text_hash(str(text))[:12]}"


class DocumentProcessor:
    def __init__(self, cfg):
        self.cfg = cfg
        self.langid = LanguageIdentifier(cfg.language) if cfg.language.enabled else None
        self.filter = HeuristicFilter(cfg.filters)
        self.pii = PIIRedactor(cfg.pii) if cfg.pii.enabled else None
        self.harm = HarmScorer(cfg.harm) if cfg.harm.enabled else None
        self.quality = QualityModel.load(cfg.quality.model) if cfg.quality.model else None
        self.minhash = MinHasher(cfg.dedup) if cfg.dedup.fuzzy else None
        self.embed = None
        if cfg.dedup.semantic.enabled:
            from lmfoundry.data.embed import Embedder

            self.embed = Embedder()

    def __call__(self, batch: pa.Table, shard: int, first_row: int, path: str) -> pa.Table:
        cfg = self.cfg
        if cfg.text_field not in batch.column_names:
            raise ValueError(
                f"{path}: no text field {cfg.text_field!r}; its fields are {batch.column_names} "
                "(set text_field in the curate config)"
            )
        n = batch.num_rows
        raw = batch.column(cfg.text_field).to_pylist()
        reason = [KEPT] * n
        stage = [""] * n
        texts: list[str] = []
        chars_in = np.zeros(n, np.int64)
        boiler = np.zeros(n, np.int32)
        c4_removed = np.zeros(n, np.int32)

        def reject(i: int, why: str, where: str):
            reason[i], stage[i] = why, where

        for i, r in enumerate(raw):
            if not isinstance(r, str):
                texts.append("" if r is None else str(r))
                reject(i, "text_not_a_string", "read")
                continue
            chars_in[i] = len(r)
            t, boiler[i] = normalize_text(r, cfg.drop_boilerplate_lines)
            texts.append(t)
            if not t:
                reject(i, "empty_after_normalisation", "normalise")

        langs, lang_conf = [UNKNOWN] * n, [None] * n
        if self.langid is not None:
            todo = [i for i in range(n) if reason[i] == KEPT]
            for i, (lang, conf) in zip(todo, self.langid([texts[i] for i in todo])):
                langs[i], lang_conf[i] = lang, conf
                if not self.langid.allowed(lang):
                    reject(i, "language_not_allowed", "language")

        for i in range(n):
            if reason[i] == KEPT:
                texts[i], why, c4_removed[i] = self.filter(texts[i], langs[i])
                if why:
                    reject(i, why, "heuristic")

        pii_counts: dict[str, np.ndarray] = {}
        if self.pii is not None:
            pii_counts = {k: np.zeros(n, np.int32) for k in self.pii.cfg.types}
            for i in range(n):
                texts[i], counts = self.pii.redact(texts[i])
                for k, c in counts.items():
                    pii_counts[k][i] = c

        harm = [None] * n
        if self.harm is not None:
            todo = [i for i in range(n) if reason[i] == KEPT]
            for i, s in zip(todo, self.harm([texts[i] for i in todo])):
                harm[i] = s
                if self.harm.harmful(s):
                    reject(i, "harmful_content", "harm")

        quality = [None] * n
        if self.quality is not None:
            todo = [i for i in range(n) if reason[i] == KEPT]
            for i, s in zip(todo, self.quality([texts[i] for i in todo])):
                quality[i] = float(s)
                if s < cfg.quality.threshold:
                    reject(i, "low_quality_score", "quality")

        density = (
            [knowledge_density(texts[i], langs[i]) if reason[i] == KEPT else None for i in range(n)]
            if cfg.density.enabled
            else [None] * n
        )

        kept_idx = [i for i in range(n) if reason[i] == KEPT]
        hashes = [xxhash.xxh3_64_intdigest(texts[i].encode()) if reason[i] == KEPT else None for i in range(n)]
        signature: list = [None] * n
        buckets: list = [None] * n
        if self.minhash is not None and kept_idx:
            sigs, keys = self.minhash([texts[i] for i in kept_idx])
            for j, i in enumerate(kept_idx):
                signature[i], buckets[i] = sigs[j], keys[j]

        embedding: list = [None] * n
        if self.embed is not None and kept_idx:
            for i, e in zip(kept_idx, self.embed([texts[i] for i in kept_idx])):
                embedding[i] = e.tolist()

        if cfg.id_field in batch.column_names:
            ids = [None if v is None else str(v) for v in batch.column(cfg.id_field).to_pylist()]
            ids = [v if v is not None else derive_id(path, first_row + i, raw[i]) for i, v in enumerate(ids)]
        else:
            ids = [derive_id(path, first_row + i, raw[i]) for i in range(n)]
        carried = batch.drop_columns([c for c in (cfg.text_field, cfg.id_field) if c in batch.column_names])
        keys = (np.int64(shard) << SHARD_BITS) + first_row + np.arange(n, dtype=np.int64)
        columns = {
            "doc_key": pa.array(keys, pa.int64()),
            cfg.id_field: pa.array(ids, pa.string()),
            cfg.text_field: pa.array(texts, pa.string()),
            "reason": pa.array(reason, pa.string()),
            "stage": pa.array(stage, pa.string()),
            "duplicate_of": pa.nulls(n, pa.string()),
            "lang": pa.array(langs, pa.string()),
            "lang_confidence": pa.array(lang_conf, pa.float32()),
            "harm_score": pa.array(harm, pa.float32()),
            "quality_score": pa.array(quality, pa.float32()),
            "knowledge_density": pa.array(density, pa.float32()),
            **{f"pii_{k}": pa.array(v, pa.int32()) for k, v in pii_counts.items()},
            "chars_in": pa.array(chars_in, pa.int64()),
            "boilerplate_lines_removed": pa.array(boiler, pa.int32()),
            "c4_lines_removed": pa.array(c4_removed, pa.int32()),
            "_text_hash": pa.array(hashes, pa.uint64()),
            "_signature": pa.array([None if s is None else s.tolist() for s in signature], pa.list_(pa.uint32())),
            "_buckets": pa.array([None if b is None else b.tolist() for b in buckets], pa.list_(pa.uint64())),
            "_embedding": pa.array(embedding, pa.list_(pa.float32())),
        }
        out = pa.table(columns)
        for name in carried.column_names:
            if name not in columns:
                out = out.append_column(name, carried.column(name))
        return out


INTERNAL_COLUMNS = ("doc_key", "_text_hash", "_signature", "_buckets", "_embedding")
