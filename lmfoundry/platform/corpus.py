"""Documents of a corpus, for the stages that search or mine it: a curate output (its kept/
Parquet shards) or a JSONL file with `text` (and optionally `id`)."""

from __future__ import annotations

from lmfoundry.platform import storage


def read_documents(uri: str, limit: int = 100_000) -> list[dict]:
    """[{"id", "text"}], at most `limit`, in file order."""
    uri = storage.normalize(uri)
    if uri.endswith(".jsonl"):
        rows = storage.read_jsonl(uri)[:limit]
    else:
        import pyarrow.parquet as pq

        files = storage.list_files(storage.join(uri, "kept"), (".parquet",))
        if not files:
            raise FileNotFoundError(f"{uri} has no kept/ Parquet shards (a curate output) and is not a .jsonl")
        rows = []
        for f in files:
            fs, path = storage.filesystem(f)
            table = pq.read_table(fs.open_input_file(path))
            rows.extend(table.select([c for c in ("id", "text") if c in table.column_names]).to_pylist())
            if len(rows) >= limit:
                break
    missing = next((i for i, r in enumerate(rows) if "text" not in r), None)
    if missing is not None:
        raise ValueError(f"{uri}: document {missing} has no 'text'")
    return [{"id": str(r.get("id", i)), "text": r["text"]} for i, r in enumerate(rows[:limit])]
