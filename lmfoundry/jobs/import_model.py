"""Import a local Hugging Face checkpoint directory as an lmfoundry checkpoint.

lmfoundry import hf path/to/Qwen3-0.6B work/qwen3-0.6b [--max-seq-len 4096] [--dtype bfloat16]

SRC holds config.json, safetensors weights (sharded or not), tokenizer.json and
tokenizer_config.json with a chat template. OUT becomes a sealed checkpoint that evaluate, serve,
align and export take like any other. A complete OUT is never overwritten; a partial one (no
manifest: an import cut short) is cleared and redone.
"""

import argparse
import shutil
import sys
from pathlib import Path

from lmfoundry.model.hf_import import DTYPES, FAMILIES, import_hf
from lmfoundry.platform import checkpoint


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="lmfoundry import", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("format", choices=["hf"], help=f"hf: a Hugging Face checkpoint of {', '.join(FAMILIES)}")
    p.add_argument("source", help="local directory of the Hugging Face checkpoint")
    p.add_argument("output", help="local directory to write the lmfoundry checkpoint to")
    p.add_argument("--max-seq-len", type=int, default=None, help="context to serve and train at (default: the model's)")
    p.add_argument("--dtype", choices=list(DTYPES), default="auto", help="weights' dtype (auto: as in the source)")
    args = p.parse_args(argv)
    out = Path(args.output)
    if (out / checkpoint.CHECKPOINT_MANIFEST).exists():
        print(f"error: import: {out} is already a checkpoint; choose another output", file=sys.stderr)
        return 2
    if args.max_seq_len is not None and args.max_seq_len < 1:
        print(f"error: import: --max-seq-len must be at least 1 (got {args.max_seq_len})", file=sys.stderr)
        return 2
    shutil.rmtree(out, ignore_errors=True)
    try:
        cfg, source = import_hf(args.source, out, args.max_seq_len, args.dtype)
    except (ValueError, FileNotFoundError) as e:
        shutil.rmtree(out, ignore_errors=True)
        print(f"error: import: {e}", file=sys.stderr)
        return 2
    checkpoint.seal(out, {"step": 0, "imported_from": source})
    kind = "MoE" if cfg.moe else "dense"
    print(f"imported {args.source} ({source['model_type']}, {kind}, {cfg.n_layer} layers) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
