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
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) >= 8:
                docs.append(doc.strip())
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


def build_sample_corpus(out_dir: str | Path, num_clean_docs: int = 1500, seed: int = 0, shards: int = 4) -> dict:
    """Write `shards` gzip JSON-lines files of {id, text, source, noise} to `out_dir`."""
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with gzip.open(out / f"part-{s:05d}.jsonl.gz", "wt", encoding="utf-8") as f:
            for j in range(s, len(docs), shards):
                f.write(json.dumps({"id": f"sample-{j:07d}", **docs[j]}) + "\n")
    counts: dict[str, int] = {}
    for d in docs:
        counts[d["noise"]] = counts.get(d["noise"], 0) + 1
    logger.info("sample corpus: %d documents in %d shards at %s (%s)", len(docs), shards, out, counts)
    return {"documents": len(docs), "by_noise": counts}
