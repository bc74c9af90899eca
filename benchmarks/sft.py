"""Supervised fine-tuning throughput: lmfoundry's SFT stage against TRL's SFTTrainer, side by side.

    python benchmarks/sft.py            # about 4 minutes on 2 CPU cores
    python benchmarks/sft.py --quick    # fewer steps

One tiny Llama (random weights, built with transformers, saved as a Hugging Face checkpoint) and
one tokenizer with lmfoundry's chat template; `lmfoundry import hf` turns it into the checkpoint
lmfoundry trains. Both trainers get the same sample conversations (lmfoundry.data.sample_chats),
the same rows (best-fit-decreasing packing into rows of SEQ tokens, attention within each
conversation only), the loss on assistant tokens only, the same optimizer (AdamW, the same
learning rate, warmup, cosine decay, clipping) and steps, 2 torch threads each, one after the
other on this machine. lmfoundry runs as the stage runs: Ray Train, one DeepSpeed worker (ZeRO
stage 0), checkpoints off but the last. TRL runs as its docs show: SFTConfig(packing=True,
packing_strategy="bfd", assistant_only_loss=True), padding-free, sdpa attention.

Throughput is conversation tokens (padding not counted) per second of optimizer step, median
over the steps after the first WARM. Prints a table; writes benchmarks/results/sft.json and the
two loss curves in benchmarks/results/sft_loss.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SEQ = 512  # tokens per packed row
ROWS = 8  # rows per optimizer step
LR, WARMUP = 1e-3, 5
WARM = 5  # steps left out of the medians
THREADS = 2


def build_hf(directory: Path, chats: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmfoundry.data.tokenizer import train_bpe
    from lmfoundry.model.chat_template import DEFAULT_CHAT_TEMPLATE
    from lmfoundry.model.tokenizer import EOS

    tok = train_bpe(Path(chats).read_text().splitlines() + [DEFAULT_CHAT_TEMPLATE] * 50, 2048)
    import torch

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(EOS),
        eos_token_id=tok.token_to_id(EOS),
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def run_ours(checkpoint: str, chats: str, out: Path, steps: int) -> dict:
    from lmfoundry.platform.ray_env import init_ray
    from lmfoundry.train.sft import SFTConfig, run_sft

    init_ray()
    cfg = SFTConfig(
        checkpoint=checkpoint,
        data=chats,
        output=str(out),
        max_seq_len=SEQ,
        optimizer={"lr": LR, "weight_decay": 0.0, "betas": (0.9, 0.999)},
        schedule={"warmup_steps": WARMUP, "max_steps": steps},
        batch={"micro_batch_size": ROWS, "global_batch_sequences": ROWS},
        parallelism={"num_workers": 1, "zero_stage": 0, "cpus_per_worker": THREADS},
        checkpointing={"every": steps},
        logging={"every": 1},
    )
    manifest = run_sft(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "manifest": manifest,
        "loss": [r["loss"] for r in rows],
        "tokens_per_s": [r["tokens"] / r["step_time_s"] for r in rows[WARM:]],  # 1 worker, 1 micro-batch a step
    }


def run_trl(hf_dir: Path, chats: str, out: Path, steps: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(THREADS)
    tok = PreTrainedTokenizerFast.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa")
    rows = [json.loads(line) for line in Path(chats).read_text().splitlines()]
    for row in rows:  # one Arrow schema: tools as JSON text, which TRL parses back
        row["tools"] = json.dumps(row.get("tools"))
    args = SFTConfig(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=ROWS,
        learning_rate=LR,
        lr_scheduler_type="cosine",
        warmup_steps=WARMUP,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        packing=True,
        packing_strategy="bfd",
        max_length=SEQ,
        assistant_only_loss=True,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
    )

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kw):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.started)

    timer = StepTimes()
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[timer]
    )
    packed_rows = len(trainer.train_dataset)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    tokens = [h["num_tokens"] for h in logs]  # cumulative tokens trained on
    per_step = [b - a for a, b in zip([0.0, *tokens], tokens)]
    return {
        "loss": [h["loss"] for h in logs],
        "tokens_per_s": [n / t for n, t in zip(per_step[WARM:], timer.times[WARM:])],
        "rows": packed_rows,
    }


def plot(ours: list[float], trl: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(ours) + 1), ours, marker=".", label="lmfoundry sft")
    ax.plot(range(1, len(trl) + 1), trl, marker=".", label="TRL SFTTrainer")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss on assistant tokens")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    steps = 12 if args.quick else 40
    load_before = os.getloadavg()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lmfoundry.data.sample_chats import write_chats
    from lmfoundry.jobs.import_model import main as import_main

    with tempfile.TemporaryDirectory(prefix="lmfoundry-sft-bench-") as tmp:
        work = Path(tmp)
        chats = write_chats(work / "chats.jsonl", 1024, seed=0)
        (work / "hf").mkdir()
        build_hf(work / "hf", chats)
        if import_main(["hf", str(work / "hf"), str(work / "ours")]) != 0:
            raise RuntimeError("lmfoundry import hf failed")
        ours = run_ours(str(work / "ours"), chats, work / "sft", steps)
        load_between = os.getloadavg()
        trl = run_trl(work / "hf", chats, work / "trl", steps)
    load_after = os.getloadavg()
    report = ours["manifest"]["data_report"]
    ours_tps, trl_tps = statistics.median(ours["tokens_per_s"]), statistics.median(trl["tokens_per_s"])
    RESULTS.mkdir(exist_ok=True)
    plot(ours["loss"], trl["loss"], RESULTS / "sft_loss.png", f"tiny Llama, {steps} steps of {ROWS} x {SEQ} tokens")
    result = {
        "benchmark": "sft",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU; shared with other work",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/sft.py" + (" --quick" if args.quick else ""),
        "load_average_1m": {"before": load_before[0], "between": load_between[0], "after": load_after[0]},
        "setup": {
            "model": "Llama, 4 layers, d_model 256, 4 heads (2 kv), 2,048 BPE vocab, random weights",
            "conversations": report["conversations"],
            "seq_len": SEQ,
            "rows_per_step": ROWS,
            "steps": steps,
            "torch_threads": THREADS,
            "packed_rows": {"lmfoundry": report["rows"], "trl": trl["rows"]},
        },
        "tokens_per_s_median": {"lmfoundry": round(ours_tps, 1), "trl": round(trl_tps, 1)},
        "ratio_lmfoundry_over_trl": round(ours_tps / trl_tps, 3),
        "loss": {
            "lmfoundry": {"first": ours["loss"][0], "last": ours["loss"][-1]},
            "trl": {"first": trl["loss"][0], "last": trl["loss"][-1]},
        },
        "loss_plot": "benchmarks/results/sft_loss.png",
    }
    (RESULTS / "sft.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'trainer':<16}{'tokens/s (median)':>20}{'loss first':>12}{'loss last':>12}{'rows':>8}")
    for name, run, tps in (("lmfoundry sft", ours, ours_tps), ("TRL SFTTrainer", trl, trl_tps)):
        rows = report["rows"] if run is ours else trl["rows"]
        print(f"{name:<16}{tps:>20.0f}{run['loss'][0]:>12.4f}{run['loss'][-1]:>12.4f}{rows:>8}")
    print(f"ratio lmfoundry / TRL: {ours_tps / trl_tps:.2f}x; load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
