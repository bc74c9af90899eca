"""Export a checkpoint (or a pretrain run's final checkpoint) for Hugging Face `transformers` and vLLM.

lmfoundry export work/quickstart/pretrain work/hf [--dtype bfloat16] [--max-shard-size 2GB]

The architecture is the stock one that computes what the model does (Llama, Qwen2, Qwen3 for
dense models; Glm4Moe, Mixtral, Qwen3-MoE or Qwen2-MoE for MoE: docs/training.md).
"""

import argparse
import sys

from lmfoundry.model.export import DEFAULT_MAX_SHARD_BYTES, EXPORT_DTYPES, export_hf, parse_size
from lmfoundry.platform import checkpoint


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="lmfoundry export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", help="a checkpoint directory or a pretrain run directory")
    p.add_argument("output", help="directory to write the exported model to")
    p.add_argument("--format", choices=["hf"], default="hf", help="hf: a stock transformers architecture, safetensors")
    p.add_argument("--dtype", choices=list(EXPORT_DTYPES), default="float32", help="the weights' dtype")
    p.add_argument(
        "--max-shard-size",
        default=f"{DEFAULT_MAX_SHARD_BYTES >> 30}GB",
        help="past this size the weights are sharded, with model.safetensors.index.json (e.g. 2GB, 500MB)",
    )
    args = p.parse_args(argv)
    try:
        max_shard_bytes = parse_size(args.max_shard_size)
        with checkpoint.opened(args.checkpoint, model_only=True) as (local, _):
            out = export_hf(local, args.output, args.dtype, max_shard_bytes)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: export: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out} (format {args.format}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
