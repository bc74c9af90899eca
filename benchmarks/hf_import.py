"""Peak memory of importing (and exporting) a ~1B-parameter Hugging Face checkpoint, against the
checkpoint's size.

The checkpoint has Llama 3.2 1B's shape (16 layers, d_model 2048, 32 query and 8 key/value
heads, SwiGLU 8192, vocabulary 128256, tied embeddings, Llama 3 RoPE scaling) with random bf16
weights, in two shards with an index. It is written by the streaming writer one tensor at a
time, so building it needs no more memory than its largest tensor. Then `lmfoundry import hf`
runs in a child process, and `lmfoundry export --dtype bfloat16 --max-shard-size 1GB` of the
result in another; each child's peak resident set (ru_maxrss) is the figure, with the resident
set of a child that only starts Python and imports the same modules given for reference.

    python benchmarks/hf_import.py                   # ~1.2B parameters, ~2.5 GB of bf16
    python benchmarks/hf_import.py --layers 2        # a quick CPU-sized run

Prints a table; writes benchmarks/results/hf_import.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmfoundry.model.tensor_files import INDEX, write_safetensors

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
TEMPLATE = "{% for m in messages %}<|start|>{{ m.role }}\n{{ m.content }}<|eot|>{% endfor %}<|start|>assistant\n"


def tensor_specs(c: dict) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    C, F, D = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    H, K = c["num_attention_heads"], c["num_key_value_heads"]
    specs = [("model.embed_tokens.weight", (c["vocab_size"], C))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (C,)),
            (p + "post_attention_layernorm.weight", (C,)),
            (p + "self_attn.q_proj.weight", (H * D, C)),
            (p + "self_attn.k_proj.weight", (K * D, C)),
            (p + "self_attn.v_proj.weight", (K * D, C)),
            (p + "self_attn.o_proj.weight", (C, H * D)),
            (p + "mlp.gate_proj.weight", (F, C)),
            (p + "mlp.up_proj.weight", (F, C)),
            (p + "mlp.down_proj.weight", (C, F)),
        ]
    specs.append(("model.norm.weight", (C,)))
    return [(name, torch.bfloat16, shape) for name, shape in specs]


def write_checkpoint(directory: Path, config: dict) -> int:
    """The random checkpoint, two shards, one tensor in memory at a time. Returns its bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    directory.mkdir(parents=True)
    specs = tensor_specs(config)
    half = len(specs) // 2
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, part in enumerate((specs[:half], specs[half:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = (
            torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02).to(dtype) for _, dtype, shape in part
        )
        write_safetensors(directory / name, part, tensors)
        weight_map |= {n: name for n, _, _ in part}
    (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    specials = ["<s>", "</s>", "<|start|>", "<|eot|>"]
    tok.train_from_iterator(["a tiny corpus for a tokenizer"] * 10, trainers.BpeTrainer(special_tokens=specials))
    tok.save(str(directory / "tokenizer.json"))
    tok_config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def peak_rss_of(argv: list[str]) -> tuple[int, float]:
    """Peak resident set (bytes) and seconds of `argv`, run under GNU time: a child forked from
    this process would count this process's own resident set (the checkpoint builder's) as its
    high-water mark until it execs, so the measured one is forked from `time` instead."""
    time_bin = shutil.which("time") or "/usr/bin/time"
    if not Path(time_bin).exists():
        raise RuntimeError("GNU time is needed to measure a child's own peak (Debian: apt-get install time)")
    start = time.perf_counter()
    r = subprocess.run([time_bin, "-f", "maxrss_kib=%M", *argv], capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if r.returncode != 0:
        raise RuntimeError(f"{argv} failed: {r.stderr[-2000:]}")
    kib = int(r.stderr.rsplit("maxrss_kib=", 1)[1].split()[0])
    return kib * 1024, seconds


def memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    args = ap.parse_args()
    config = CONFIG | {"num_hidden_layers": args.layers}
    work = Path(tempfile.mkdtemp(prefix="hf-import-bench-"))
    try:
        t = time.perf_counter()
        size = write_checkpoint(work / "hf", config)
        build_s = time.perf_counter() - t
        params = sum(torch.Size(s).numel() for _, _, s in tensor_specs(config))
        py = sys.executable
        argv = [py, "-m", "lmfoundry.platform.cli", "import", "hf", str(work / "hf"), str(work / "ours")]
        imp_peak, imp_s = peak_rss_of(argv)
        exp_argv = ["export", str(work / "ours"), str(work / "back"), "--dtype", "bfloat16", "--max-shard-size", "1GB"]
        exp_peak, exp_s = peak_rss_of([py, "-m", "lmfoundry.platform.cli", *exp_argv])
        exported = sum(p.stat().st_size for p in (work / "back").glob("*.safetensors"))
        shards = len(list((work / "back").glob("*.safetensors")))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # the Python, torch and lmfoundry a child starts with, before any weight is read
    code = "import lmfoundry.model.hf_import, lmfoundry.model.export, lmfoundry.platform.checkpoint"
    base_peak, _ = peak_rss_of([py, "-c", code])

    gib = 2**30
    rows = [
        {"step": "import hf", "peak_rss_gib": imp_peak / gib, "ratio_to_checkpoint": imp_peak / size, "seconds": imp_s},
        {
            "step": "export (bf16, 1GB shards)",
            "peak_rss_gib": exp_peak / gib,
            "ratio_to_checkpoint": exp_peak / size,
            "seconds": exp_s,
        },
    ]
    print(
        f"checkpoint: {params / 1e9:.2f}B parameters, {size / gib:.2f} GiB of bf16 in 2 shards (built in {build_s:.0f} s)"
    )
    print(f"{'step':<28} {'peak RSS GiB':>12} {'x checkpoint':>13} {'seconds':>8}")
    for r_ in rows:
        print(f"{r_['step']:<28} {r_['peak_rss_gib']:12.2f} {r_['ratio_to_checkpoint']:13.2f} {r_['seconds']:8.1f}")
    print(f"(a child that only imports the modules: {base_peak / gib:.2f} GiB; the export wrote {shards} shards)")
    RESULTS.mkdir(exist_ok=True)
    out = {
        "machine": f"{platform.machine()}, {platform.system()}, {os.cpu_count()} CPU cores, {memory_gib():.0f} GiB, no GPU",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", "benchmarks/hf_import.py", *sys.argv[1:]]),
        "checkpoint": {
            "shape": "Llama 3.2 1B (random bf16 weights, 2 shards)",
            "parameters": params,
            "gib": size / gib,
        },
        "target_ratio": 1.2,
        "steps": rows,
        "python_and_modules_gib": base_peak / gib,
        "export_shards": shards,
        "exported_gib": exported / gib,
    }
    (RESULTS / "hf_import.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
