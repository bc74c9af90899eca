"""A tiny open model with random weights, built by `transformers` itself and saved in the Hugging
Face layout (`config.json`, safetensors, `tokenizer.json`, `tokenizer_config.json` with its chat
template, `generation_config.json`): the README's open-model path (import, fine-tune, evaluate,
serve) runs on it with nothing downloaded. A real run starts from a real checkpoint directory.

    python -m lmfoundry.data.sample_checkpoint work/tiny-hf [--family qwen3]

The tokenizer is a byte-level BPE trained on the sample conversations (data/sample_chats.py) and
the chat template, with ChatML's turn markers as special tokens; the template is lmfoundry's
(ChatML, tools, the assistant's text marked for fine-tuning).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# family -> its transformers config class (imported only when a checkpoint is built)
FAMILIES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
# small enough to fine-tune on two CPU workers in seconds, large enough for the sample chats
SHAPE = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
VOCAB_SIZE = 512


def hf_config(family: str, vocab_size: int, eos_id: int, pad_id: int):
    import transformers

    extra = {}
    if family == "mistral":
        extra["sliding_window"] = None  # its default (4,096) would be a window inside a longer context
    if family == "qwen3":
        extra["head_dim"] = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]  # its default is 128
    return getattr(transformers, FAMILIES[family])(
        **SHAPE,
        **extra,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        bos_token_id=None,  # the template writes none (Llama's default id would be another token here)
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def build_sample_checkpoint(out: str | Path, family: str = "qwen3", seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from lmfoundry.data.sample_chats import conversation
    from lmfoundry.data.tokenizer import train_bpe
    from lmfoundry.model.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
    from lmfoundry.model.tokenizer import EOS, IM_END

    if family not in FAMILIES:
        raise ValueError(f"family {family!r}; allowed: {', '.join(FAMILIES)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # saving into a real checkpoint's directory would delete its weight shards
        raise ValueError(f"{out} exists and is not an empty directory: give a new path")
    template, rng = ChatTemplate(), random.Random(seed)
    chats = [conversation(rng, i) for i in range(256)]
    texts = [template.render(c["messages"], c.get("tools", ())) for c in chats]
    # the template's own text too, so that its markup merges into a few tokens
    tok = train_bpe(texts + [DEFAULT_CHAT_TEMPLATE] * 8, VOCAB_SIZE)
    eos_id, pad_id = tok.token_to_id(IM_END), tok.token_to_id(EOS)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, tok.get_vocab_size(), eos_id, pad_id))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,  # as Qwen's: the template writes no beginning-of-sequence token
        "eos_token": IM_END,  # an instruct model's turn ends its generation
        "pad_token": EOS,
        "model_max_length": SHAPE["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id, pad_id], "pad_token_id": pad_id}))
    return out


def seed_value(text: str) -> int:
    seed = int(text)
    if not 0 <= seed < 2**32:
        raise argparse.ArgumentTypeError(f"{seed} is not a seed: allowed 0 to 2**32 - 1")
    return seed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmfoundry.data.sample_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("output", help="the directory to write the Hugging Face checkpoint to")
    p.add_argument("--family", default="qwen3", choices=list(FAMILIES))
    p.add_argument("--seed", type=seed_value, default=0)
    args = p.parse_args(argv)
    try:
        out = build_sample_checkpoint(args.output, args.family, args.seed)
    except ImportError as e:
        print(f"error: the sample checkpoint is built by transformers: pip install transformers ({e})", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a tiny {args.family} checkpoint with random weights to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
