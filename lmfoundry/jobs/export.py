"""Export a checkpoint (or a pretrain run's final checkpoint) for Hugging Face `transformers` and vLLM.

lmfoundry export work/quickstart/pretrain --format hf work/hf
"""

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="lmfoundry export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", help="a checkpoint directory or a pretrain run directory")
    p.add_argument("output", help="directory to write the exported model to")
    p.add_argument("--format", choices=["hf"], default="hf", help="hf: Llama architecture, safetensors")
    args = p.parse_args(argv)
    from lmfoundry.model.export import export_hf  # torch: after parsing, so that --help answers at once
    from lmfoundry.platform import checkpoint

    try:
        with checkpoint.opened(args.checkpoint, model_only=True) as (local, _):
            out = export_hf(local, args.output)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: export: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out} (format {args.format})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
