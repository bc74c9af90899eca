"""A sample corpus built at run time from text every Python install has, plus web-like noise.

The clean part is the docstrings of the standard library, read with `ast` (nothing is imported
or executed). The noise imitates a web crawl so that every curation filter has work to do:
cookie banners and navigation lines inside real documents, spam, keyword lists, too-short pages,
exact copies and near copies. Each noisy document records in `noise` what was done to it, so
tests can check that the filters removed what they should.
"""

from __future__ import annotations

import ast
import gzip
import json
import random
import sysconfig
from pathlib import Path

from lmfoundry.platform import storage
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)

_BOILERPLATE = [
    "We use cookies to improve your experience. By continuing you accept our cookie policy.",
    "Home | About | Blog | Contact | Privacy",
    "Click here to subscribe to our newsletter!",
    "Share on Facebook Share on Twitter Share on LinkedIn",
    "All rights reserved.",
]
_SPAM_WORDS = ["BUY", "NOW", "cheap", "pills", "$$$", "WIN", "FREE", "casino", "!!!", "click", "deal"]


def _module_docs(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    docs = []
    seen_lines: set[str] = set()  # overloads and subclasses repeat their parents' lines
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if not doc:
                continue
            lines = [line for line in doc.strip().split("\n") if not line.strip() or line not in seen_lines]
            seen_lines.update(line for line in lines if line.strip())
            doc = "\n".join(lines).strip()
            if len(doc.split()) >= 8:
                docs.append(doc)
    return docs


def stdlib_documents(max_docs: int, min_chars: int = 400, max_chars: int = 4000) -> list[str]:
    """Docstrings of the standard library, grouped per module into documents of a few KB."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    out: list[str] = []
    for path in files:
        current: list[str] = []
        for doc in _module_docs(path):
            current.append(doc)
            if sum(len(d) for d in current) >= max_chars:
                out.append("\n\n".join(current))
                current = []
        if current and sum(len(d) for d in current) >= min_chars:
            out.append("\n\n".join(current))
        if len(out) >= max_docs:
            break
    return out[:max_docs]


def _near_copy(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    for _ in range(max(1, len(words) // 50)):
        i = rng.randrange(len(words))
        words[i] = words[i].upper()
    return " ".join(words)


def _spam(rng: random.Random) -> str:
    line = " ".join(rng.choice(_SPAM_WORDS) for _ in range(12))
    return "\n".join([line] * rng.randint(5, 20))


def _keyword_list(rng: random.Random) -> str:
    return " ".join(f"#{rng.choice(_SPAM_WORDS).strip('$!')}{rng.randint(0, 99)}" for _ in range(60))


_SEO = (
    "Best {x} deals {y}! Top 10 {x} reviews. Cheap {x} online, free shipping. Buy {x} now and save. "
    "Compare {x} prices. {x} near me. {x} {y} sale today only. Click for the best {x} offers!"
)
_TOPICS = ["shoes", "phones", "loans", "hotels", "watches", "casino", "diet pills", "crypto", "flights", "insurance"]


def _word_salad(rng: random.Random, vocabulary: list[str], n: int) -> str:
    """Real words in random order: the vocabulary of good text without its syntax."""
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def web_like_documents(n: int, seed: int = 0) -> list[str]:
    """Random web-like text, the negative class of the quality classifier (GPT-3 and DCLM trained
    theirs against unfiltered Common Crawl): spam, SEO pages, keyword lists, navigation and cookie
    chrome, word salad built from the standard library's own vocabulary."""
    rng = random.Random(seed)
    vocabulary = [w for d in stdlib_documents(50) for w in d.split() if w.isalpha()]
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            out.append(_spam(rng))
        elif kind == 1:
            out.append(" ".join(_SEO.format(x=rng.choice(_TOPICS), y=rng.randint(2019, 2026)) for _ in range(3)))
        elif kind == 2:
            out.append(_keyword_list(rng))
        elif kind == 3:
            out.append("\n".join(rng.sample(_BOILERPLATE, 3) + [_word_salad(rng, vocabulary, 30)]))
        else:
            out.append(_word_salad(rng, vocabulary, rng.randint(80, 300)))
    return out


def planted_duplicates(
    num_groups: int,
    copies: int = 3,
    seed: int = 0,
    words: int = 300,
    levels: tuple[float, ...] = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0),
):
    """A corpus with planted near duplicates at known Jaccard levels, for measuring dedup.

    Each group is an original document (words drawn from a Zipf-like vocabulary, so unrelated
    documents share almost no 5-grams) and `copies` edited copies, each edited until its Jaccard
    similarity to the original (word 5-gram shingles) falls to a level drawn from `levels`: word
    substitutions, insertions, deletions and swaps of whole sentences. Returns the texts, each
    text's group, and the true Jaccard of every pair within a group.
    """
    import numpy as np

    from lmfoundry.data.dedup import jaccard, shingle_hashes

    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(20000)]
    weights = [1 / (i + 1) for i in range(len(vocabulary))]

    def original() -> list[str]:
        return rng.choices(vocabulary, weights, k=words)

    def edit(doc: list[str]) -> None:
        op = rng.random()
        i = rng.randrange(len(doc))
        if op < 0.4:
            doc[i] = rng.choice(vocabulary)
        elif op < 0.6:
            doc.insert(i, rng.choice(vocabulary))
        elif op < 0.8 and len(doc) > 10:
            del doc[i]
        else:  # move a 12-word "sentence" elsewhere
            j = rng.randrange(max(1, len(doc) - 12))
            chunk = doc[j : j + 12]
            del doc[j : j + 12]
            k = rng.randrange(len(doc) + 1)
            doc[k:k] = chunk

    texts, groups = [], []
    for g in range(num_groups):
        base = original()
        base_sh = shingle_hashes(" ".join(base), 5)
        texts.append(" ".join(base))
        groups.append(g)
        for _ in range(copies):
            target = rng.choice(levels)
            doc = list(base)
            while target < 1.0 and jaccard(base_sh, shingle_hashes(" ".join(doc), 5)) > target:
                edit(doc)
            texts.append(" ".join(doc))
            groups.append(g)
    truth: dict[tuple[int, int], float] = {}
    groups_arr = np.array(groups)
    for g in range(num_groups):
        members = np.flatnonzero(groups_arr == g).tolist()
        sh = {m: shingle_hashes(texts[m], 5) for m in members}
        for x in range(len(members)):
            for y in range(x + 1, len(members)):
                truth[(members[x], members[y])] = jaccard(sh[members[x]], sh[members[y]])
    return texts, groups, truth


def build_sample_corpus(out_dir: str | Path, num_clean_docs: int = 1500, seed: int = 0, shards: int = 4) -> dict:
    """Write `shards` gzip JSON-lines files of {id, text, source, noise} to `out_dir` (a local
    path or s3://)."""
    rng = random.Random(seed)
    clean = stdlib_documents(num_clean_docs)
    if not clean:
        raise RuntimeError("found no standard-library docstrings to build the sample corpus from")
    docs: list[dict] = []
    for text in clean:
        noise = "clean"
        if rng.random() < 0.15:  # web page chrome around real content
            text = "\n".join([rng.choice(_BOILERPLATE), text, rng.choice(_BOILERPLATE)])
            noise = "boilerplate_lines"
        docs.append({"text": text, "source": "stdlib", "noise": noise})
    n = len(clean)
    for _ in range(n // 10):
        docs.append({"text": rng.choice(clean), "source": "web", "noise": "exact_duplicate"})
    for _ in range(n // 20):
        docs.append({"text": _near_copy(rng.choice(clean), rng), "source": "web", "noise": "near_duplicate"})
    for _ in range(n // 20):
        docs.append({"text": _spam(rng), "source": "web", "noise": "spam"})
    for _ in range(n // 40):
        docs.append({"text": _keyword_list(rng), "source": "web", "noise": "keyword_list"})
    for _ in range(n // 40):
        docs.append({"text": rng.choice(_BOILERPLATE), "source": "web", "noise": "too_short"})
    rng.shuffle(docs)
    out = storage.normalize(str(out_dir))
    for s in range(shards):
        lines = "".join(json.dumps({"id": f"sample-{j:07d}", **docs[j]}) + "\n" for j in range(s, len(docs), shards))
        storage.write_bytes_atomic(storage.join(out, f"part-{s:05d}.jsonl.gz"), gzip.compress(lines.encode(), mtime=0))
    counts: dict[str, int] = {}
    for d in docs:
        counts[d["noise"]] = counts.get(d["noise"], 0) + 1
    logger.info("sample corpus: %d documents in %d shards at %s (%s)", len(docs), shards, out, counts)
    return {"documents": len(docs), "by_noise": counts}
