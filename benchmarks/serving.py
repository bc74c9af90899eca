"""Serving throughput and time to first token: lmfoundry's continuous batching against Hugging
Face `transformers` `generate` on the same weights (exported to Llama format), and the HTTP
overhead of the Ray Serve API.

    python benchmarks/serving.py            # about 20 minutes on 2 CPU cores
    python benchmarks/serving.py --quick    # concurrency 1 and 4 only, fewer tokens
    python benchmarks/serving.py --dtypes float32

The model is Llama-shaped, about 16M parameters (8 layers, d_model 384, GQA 6/2 heads, an 8,192
BPE vocabulary trained here on standard-library docstrings), with random weights: throughput
does not depend on what the weights say, and every request generates exactly `--max-tokens`
tokens (stop tokens are switched off on both sides) so that both sides do the same work.
Every comparison runs both sides in one precision: float32, then bfloat16 (the engine's
`dtype: bfloat16`; Hugging Face loaded with dtype=torch.bfloat16), each with its own table.

For each concurrency c in 1, 4, 16, 64: c client streams start at uniformly random times over
the first `--spread` seconds; each sends `--rounds` requests one after another (the next when
the last has ended), prompts of 16-64 random tokens.
- lmfoundry: each request joins the continuous batch when it is sent (ContinuousBatcher, the
  engine the API runs, its linear layers packed for oneDNN); and the same with the linear layers
  left as nn.Linear, to tell the packing's share of the speed from the machine's.
- HF one at a time: a server that runs `generate` for one request after another, oldest first;
  time to first token includes the wait in its queue.
- HF static batch: one round of the c streams' requests left-padded into one batch and one
  `generate` call, started when that round's last request is there (the best a static batcher
  does); every request's first token comes with the batch's result.
Each run is a fresh process (spawned), so no system inherits another's threads: on CPU, torch
ops slow down for good once a second thread of a process has run OpenMP-parallel work.
Throughput is generated tokens over the time from the first request to the last token. First,
the decode step's attention is timed alone, scaled_dot_product_attention against the model's
decode_attention on the same tensors, and the whole decode step with the linear layers as
nn.Linear against packed for oneDNN (what the engine runs on CPU). Then 20
requests go through the HTTP API on Ray Serve one at a time, and the API's overhead per request
is its latency minus the engine's time for the same request measured alone.
Prints a table; writes benchmarks/results/serving.json.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmfoundry.data.sample_corpus import stdlib_documents
from lmfoundry.data.tokenizer import train_bpe
from lmfoundry.model.checkpoint import TOKENIZER, load_model_files, save_model_files
from lmfoundry.model.export import export_hf
from lmfoundry.model.transformer import KVCache, ModelConfig, Transformer
from lmfoundry.platform import checkpoint
from lmfoundry.serving.engine import DTYPES, load_for_serving
from lmfoundry.serving.packed_linear import supported
from lmfoundry.serving.sampling import SamplingParams
from lmfoundry.serving.scheduler import ContinuousBatcher

RESULTS = Path(__file__).resolve().parent / "results"
PAD_ID = 0  # left padding of the static batch; masked out, so any id does


def build_checkpoint(directory: Path, vocab: int, context: int) -> Transformer:
    torch.manual_seed(0)
    tok = train_bpe(stdlib_documents(2000), vocab_size=vocab)
    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        max_seq_len=context,
        n_layer=8,
        d_model=384,
        n_head=6,
        n_kv_head=2,
        ffn_hidden_size=1024,
    )
    model = Transformer(cfg).eval()
    save_model_files(model, directory)
    (directory / TOKENIZER).write_text(tok.to_str())
    checkpoint.seal(directory, {"step": 0})
    return model


def workload(c: int, rounds: int, vocab: int, spread: float, seed: int) -> tuple[list[float], list[list[list[int]]]]:
    """Start offsets of c streams (the first at 0) and each stream's prompts, one per round."""
    rng = random.Random(seed + c)
    starts = sorted(rng.uniform(0, spread) for _ in range(c))
    starts = [t - starts[0] for t in starts]
    prompts = [[[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(rounds)] for _ in range(c)]
    return starts, prompts


def summary(name: str, c: int, t0: float, ends: list[float], ttfts: list[float], tokens: int) -> dict:
    wall = max(ends) - t0
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) > 1 else ttfts * 99
    return {
        "system": name,
        "concurrency": c,
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p99_s": round(q[98], 4),
    }


def run_lmfoundry(ckpt: Path, starts, prompts, max_tokens: int, dtype: str, packed: bool = True) -> dict:
    """packed=False: the engine with its linear layers left as nn.Linear (not what it runs)."""
    c, rounds = len(starts), len(prompts[0])

    def load():
        return load_for_serving(ckpt, "cpu", dtype) if packed else load_model_files(ckpt).to(DTYPES[dtype])

    batcher = ContinuousBatcher(load, frozenset(), max_batch_size=min(c, 64), max_waiting=1024)
    ended: queue.Queue = queue.Queue()  # (stream, round) of each request that has ended
    sent, first, counts, ends = {}, {}, {}, []

    def submit(stream: int, r: int) -> None:
        key = (stream, r)
        counts[key] = 0

        def emit(item):
            if isinstance(item, int):
                counts[key] += 1
                first.setdefault(key, time.perf_counter())
            else:
                ends.append(time.perf_counter())
                ended.put(key)

        sent[key] = time.perf_counter()
        batcher.submit(prompts[stream][r], SamplingParams(max_tokens, 0.0), emit)

    try:
        t0 = time.perf_counter()
        for stream in sorted(range(c), key=lambda i: starts[i]):
            time.sleep(max(0.0, t0 + starts[stream] - time.perf_counter()))
            submit(stream, 0)
        for _ in range(c * rounds):
            stream, r = ended.get()
            if r + 1 < rounds:
                submit(stream, r + 1)
    finally:
        batcher.close()
    assert all(n == max_tokens for n in counts.values()), counts
    return summary(
        "lmfoundry continuous batching" + ("" if packed else ", nn.Linear"),
        c,
        t0,
        ends,
        [first[k] - sent[k] for k in sent],
        sum(counts.values()),
    )


class FirstToken:
    """A `generate` streamer that notes when the first generated token comes out."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


def hf_generate(hf, prompts: list[list[int]], max_tokens: int, pad_id: int, streamer=None) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=streamer,
        )
    return (out.shape[1] - width) * len(prompts)


def load_hf(hf_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # exactly max_tokens, as on our side
    return hf


def in_subprocess(threads: int, fn, *args):
    """fn(*args) in a fresh spawned process with `threads` torch threads; returns its result."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1, initializer=torch.set_num_threads, initargs=(threads,)) as pool:
        return pool.apply(fn, args)


def run_system(system: str, work: Path, starts, prompts, max_tokens: int, dtype_name: str) -> dict:
    if system in ("lmf", "lmf-linear"):
        return run_lmfoundry(work / "ckpt", starts, prompts, max_tokens, dtype_name, packed=system == "lmf")
    hf = load_hf(work / "hf", DTYPES[dtype_name])
    if system == "seq":
        return run_hf_sequential(hf, starts, prompts, max_tokens, PAD_ID)
    return run_hf_static(hf, starts, prompts, max_tokens, PAD_ID)


def run_hf_sequential(hf, starts, prompts, max_tokens: int, pad_id: int) -> dict:
    """One request at a time, oldest first; a stream's next request is sent when its last ends."""
    c, rounds = len(starts), len(prompts[0])
    pending = [(starts[i], i, 0) for i in range(c)]  # (sent at, stream, round), relative to t0
    t0 = time.perf_counter()
    ttfts, ends, tokens = [], [], 0
    while pending:
        pending.sort()
        at, stream, r = pending.pop(0)
        time.sleep(max(0.0, t0 + at - time.perf_counter()))  # idle until it is sent
        streamer = FirstToken()
        tokens += hf_generate(hf, [prompts[stream][r]], max_tokens, pad_id, streamer)
        ttfts.append(streamer.first - (t0 + at))
        ends.append(time.perf_counter())
        if r + 1 < rounds:
            pending.append((ends[-1] - t0, stream, r + 1))
    return summary("HF generate, one at a time", c, t0, ends, ttfts, tokens)


def run_hf_static(hf, starts, prompts, max_tokens: int, pad_id: int) -> dict:
    """Round by round: the c requests of a round as one padded batch, started when the last is sent."""
    c, rounds = len(starts), len(prompts[0])
    t0 = time.perf_counter()
    sent = [t0 + s for s in starts]
    ttfts, ends, tokens, batch_s = [], [], 0, []
    for r in range(rounds):
        time.sleep(max(0.0, max(sent) - time.perf_counter()))
        streamer = FirstToken() if c == 1 else None  # HF streams only batches of one
        start = time.perf_counter()
        tokens += hf_generate(hf, [prompts[i][r] for i in range(c)], max_tokens, pad_id, streamer)
        end = time.perf_counter()
        batch_s.append(end - start)
        first = streamer.first if streamer else end  # a static batch hands out its results at the end
        ttfts += [first - t for t in sent]
        ends.append(end)
        sent = [end] * c  # every stream sends its next request when the batch returns
    return summary("HF generate, static batch", c, t0, ends, ttfts, tokens) | {
        "batch_seconds_median": round(statistics.median(batch_s), 3)
    }


def engine_seconds(ckpt: Path, texts: list[str], max_tokens: int) -> list[tuple[float, int]]:
    """Each request alone through the engine the API runs: (seconds, tokens generated)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / TOKENIZER))
    batcher = ContinuousBatcher(lambda: load_for_serving(ckpt, "cpu", "float32"), frozenset(), max_batch_size=1)
    out = []
    try:
        for text in [texts[0]] + texts:  # the first is a warm-up
            ids = tok.encode(text, add_special_tokens=False).ids
            n = min(max_tokens, batcher.context - len(ids))
            q: queue.Queue = queue.Queue()
            t = time.perf_counter()
            batcher.submit(ids, SamplingParams(n, 0.0), q.put)
            while isinstance(q.get(), int):
                pass
            out.append((time.perf_counter() - t, n))
    finally:
        batcher.close()
    return out[1:]


def serve_overhead(ckpt: Path, prompts: list[list[int]], max_tokens: int, threads: int) -> dict:
    """p50 over requests of (HTTP latency through Ray Serve) - (engine time for the same request,
    measured alone in a process with as many threads as the replica has CPUs)."""
    import httpx
    import ray
    from ray import serve
    from tokenizers import Tokenizer

    from lmfoundry.platform.ray_env import init_ray
    from lmfoundry.serving.app import ServeConfig, start

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import free_port

    tok = Tokenizer.from_file(str(ckpt / TOKENIZER))
    texts = [tok.decode(p) for p in prompts]
    engine = in_subprocess(threads, engine_seconds, ckpt, texts, max_tokens)
    init_ray()
    os.environ["LMFOUNDRY_BENCH_KEY"] = "sk-bench"
    # the replica gets as many CPUs as the engine had threads (Ray sets its OMP_NUM_THREADS so)
    url, _ = start(
        ServeConfig(
            checkpoint=str(ckpt),
            port=free_port(),
            api_keys_env="LMFOUNDRY_BENCH_KEY",
            cpus_per_replica=threads,
            guardrails={"enabled": False},
        )
    )
    overheads, http_s, one_token_s = [], [], []
    try:
        with httpx.Client(timeout=120, headers={"Authorization": "Bearer sk-bench"}) as client:
            client.post(f"{url}/v1/completions", json={"prompt": texts[0], "max_tokens": 4})
            for text in texts:  # the smallest request there is: a floor for the API's cost
                t = time.perf_counter()
                client.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 1})
                one_token_s.append(time.perf_counter() - t)
            for text, (engine_s, n) in zip(texts, engine):
                t = time.perf_counter()
                r = client.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": n, "temperature": 0})
                http = time.perf_counter() - t
                assert r.status_code == 200, r.text
                # the same work on both sides only if the API generated as many tokens (no stop token)
                if r.json()["usage"]["completion_tokens"] == n:
                    http_s.append(http)
                    overheads.append(http - engine_s)
    finally:
        serve.shutdown()
        ray.shutdown()
    return {
        "requests": len(overheads),
        "engine_p50_s": round(statistics.median(e for e, _ in engine), 4),
        "http_p50_s": round(statistics.median(http_s), 4),
        "overhead_p50_ms": round(1000 * statistics.median(overheads), 1),
        "one_token_request_p50_ms": round(1000 * statistics.median(one_token_s), 1),
    }


def attention_kernels(
    dtype_name: str = "float32", lengths=(64, 128, 256), batch: int = 16, repeats: int = 7, calls: int = 200
) -> list[dict]:
    """Microseconds per decode-step attention call at the benchmark model's shapes (6 query heads,
    2 key/value heads, head dim 64), scaled_dot_product_attention against the model's own
    decode_attention, interleaved repeat by repeat; medians. The engine picks between the two by
    timing them at load (serving/decode_attention.py): these are the same two, timed longer."""
    import torch.nn.functional as F

    from lmfoundry.serving.decode_attention import decode_attention

    rows = []
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        dtype = DTYPES[dtype_name]
        q = torch.randn(batch, 6, 1, 64, generator=gen).to(dtype)
        # views of a longer buffer, as the engine's cache is read
        k, v = (torch.randn(batch, 2, 2 * length, 64, generator=gen).to(dtype)[:, :, :length] for _ in range(2))
        filled = torch.randint(length // 2, length + 1, (batch,), generator=gen)
        mask = torch.arange(length)[None, None, None, :] < filled[:, None, None, None]
        kernels = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            "decode_attention": lambda: decode_attention(q, k, v, mask),
        }
        times: dict[str, list[float]] = {name: [] for name in kernels}
        with torch.inference_mode():
            for fn in kernels.values():
                fn()
            for _ in range(repeats):
                for name, fn in kernels.items():
                    t = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    times[name].append((time.perf_counter() - t) / calls * 1e6)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        rows.append(
            {
                "dtype": dtype_name,
                "batch": batch,
                "cache_length": length,
                "sdpa_us": round(med["sdpa"], 1),
                "decode_attention_us": round(med["decode_attention"], 1),
                "speedup": round(med["sdpa"] / med["decode_attention"], 2),
            }
        )
    return rows


def decode_steps(
    ckpt: Path, dtype_name: str, batches=(1, 16, 64), cache_length: int = 96, repeats: int = 7, steps: int = 20
) -> list[dict]:
    """Milliseconds per decode step of the benchmark model (one new token for each of `batch`
    rows, `cache_length` positions cached), its linear layers as nn.Linear against packed for
    oneDNN (serving/packed_linear.py, what the engine runs), interleaved repeat by repeat;
    medians. The greedy tokens of the two must agree."""
    dtype = DTYPES[dtype_name]
    if not supported(torch.device("cpu"), dtype):
        return []  # oneDNN does not run this precision here: the engine leaves nn.Linear as it is
    models = {"linear": load_model_files(ckpt).to(dtype), "packed": load_for_serving(ckpt, "cpu", dtype_name)}
    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompt = torch.randint(3, models["linear"].cfg.vocab_size, (batch, cache_length), generator=gen)
        caches, tokens = {}, {}
        with torch.inference_mode():
            for name, model in models.items():
                caches[name] = KVCache(model.cfg, batch, model.cfg.max_seq_len, "cpu", dtype)
                logits, _ = model(prompt, cache=caches[name])
                tokens[name] = logits[:, -1:].argmax(-1)
            agree = bool((tokens["linear"] == tokens["packed"]).all())
            times: dict[str, list[float]] = {name: [] for name in models}
            for _ in range(repeats):
                for name, model in models.items():
                    t = time.perf_counter()
                    for _ in range(steps):
                        model(tokens[name], cache=caches[name])
                    times[name].append((time.perf_counter() - t) / steps * 1e3)
                    caches[name].lengths -= steps  # every repeat decodes at the same cache length
        med = {name: statistics.median(ts) for name, ts in times.items()}
        rows.append(
            {
                "dtype": dtype_name,
                "batch": batch,
                "cache_length": cache_length,
                "linear_ms": round(med["linear"], 2),
                "packed_ms": round(med["packed"], 2),
                "speedup": round(med["linear"] / med["packed"], 2),
                "same_first_tokens": agree,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--spread", type=float, default=0.5, help="seconds over which the streams start")
    p.add_argument("--rounds", type=int, default=4, help="requests each stream sends, one after another")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of: {', '.join(DTYPES)}")
    p.add_argument("--concurrency", help="comma-separated stream counts (default 1,4,16,64; --quick: 1,4)")
    args = p.parse_args()
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= set(DTYPES):
        p.error(f"--dtypes {args.dtypes!r}: each must be one of {', '.join(DTYPES)}")
    torch.set_num_threads(args.threads)
    levels = [1, 4] if args.quick else [1, 4, 16, 64]
    if args.concurrency:
        try:
            levels = [int(c) for c in args.concurrency.split(",")]
        except ValueError:
            levels = []
        if not levels or min(levels) < 1:
            p.error(f"--concurrency {args.concurrency!r}: give positive integers separated by commas")
    max_tokens = 16 if args.quick else args.max_tokens
    work = Path(tempfile.mkdtemp(prefix="lmf-serving-bench-"))
    model = build_checkpoint(work / "ckpt", vocab=8192, context=256)
    export_hf(work / "ckpt", work / "hf")
    params = sum(p.numel() for p in model.parameters())
    vocab = model.cfg.vocab_size
    del model
    kernels = [r for dtype in dtypes for r in in_subprocess(args.threads, attention_kernels, dtype)]
    print("\n| dtype | batch | cache length | SDPA us | decode_attention us | speedup |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in kernels:
        print(
            f"| {r['dtype']} | {r['batch']} | {r['cache_length']} | {r['sdpa_us']} | "
            f"{r['decode_attention_us']} | {r['speedup']} |"
        )
    steps = [r for dtype in dtypes for r in in_subprocess(args.threads, decode_steps, work / "ckpt", dtype)]
    print("\n| dtype | batch | cache length | nn.Linear ms/step | packed ms/step | speedup | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in steps:
        print(
            f"| {r['dtype']} | {r['batch']} | {r['cache_length']} | {r['linear_ms']} | {r['packed_ms']} | "
            f"{r['speedup']} | {r['same_first_tokens']} |"
        )
    rows = []
    for dtype in dtypes:
        for c in levels:
            rounds = args.rounds if c < 64 else max(1, args.rounds // 2)
            starts, prompts = workload(c, rounds, vocab, args.spread if c > 1 else 0.0, seed=0)
            # the systems one after another on the same requests, twice (once at 64), each one's median
            # one at a time at 64: ~10 min; the engine unpacked as well, to tell its share from the machine's
            systems = ["lmf", "lmf-linear", "seq", "static"] if c <= 16 else ["lmf", "lmf-linear", "static"]
            runs: dict[str, list[dict]] = {name: [] for name in systems}
            for _ in range(1 if c == 64 else 2):
                for name in systems:
                    runs[name].append(
                        in_subprocess(args.threads, run_system, name, work, starts, prompts, max_tokens, dtype)
                    )
            for results in runs.values():
                best = sorted(results, key=lambda r: r["tokens_per_s"])[len(results) // 2]
                rows.append(best | {"rounds": rounds, "dtype": dtype})
                print(json.dumps(rows[-1]), flush=True)
    _, one_each = workload(20, 1, vocab, 0.0, seed=1)
    overhead = serve_overhead(work / "ckpt", [p[0] for p in one_each], max_tokens, args.threads)
    print("\n| dtype | concurrency | system | tokens/s | TTFT p50 s | TTFT p99 s |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['concurrency']} | {r['system']} | {r['tokens_per_s']:,.0f} | "
            f"{r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} |"
        )
    ratios: dict[str, dict[int, dict]] = {}
    for dtype in dtypes:
        ratios[dtype] = {}
        for c in levels:
            at = {r["system"]: r["tokens_per_s"] for r in rows if r["concurrency"] == c and r["dtype"] == dtype}
            lmf = at["lmfoundry continuous batching"]
            ratio = {
                "vs_one_at_a_time": round(lmf / at["HF generate, one at a time"], 2)
                if "HF generate, one at a time" in at
                else None,
                "vs_static_batch": round(lmf / at["HF generate, static batch"], 2),
            }
            ratios[dtype][c] = ratio
            print(
                f"{dtype} c={c}: lmfoundry / HF one at a time = {ratio['vs_one_at_a_time']}, "
                f"/ HF static batch = {ratio['vs_static_batch']}"
            )
    print(
        f"Serve API overhead per request, p50: {overhead['overhead_p50_ms']} ms "
        f"(engine {overhead['engine_p50_s']} s, HTTP {overhead['http_p50_s']} s, {overhead['requests']} requests); "
        f"a 1-token request takes {overhead['one_token_request_p50_ms']} ms end to end"
    )
    RESULTS.mkdir(exist_ok=True)
    out = {
        "machine": f"{os.cpu_count()} CPU",
        "torch_threads": args.threads,
        "parameters": params,
        "max_tokens": max_tokens,
        "spread_s": args.spread,
        "rounds": args.rounds,
        "rows": rows,
        "ratios": ratios,
        "serve_overhead": overhead,
        "decode_attention": kernels,
        "decode_step": steps,
    }
    (RESULTS / "serving.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
