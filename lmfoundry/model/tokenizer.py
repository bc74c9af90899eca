"""What every stage needs to know about the model's tokenizer: its special tokens and how many
bytes of text each token stands for. (Training it is curation's job: data/tokenizer.py.)"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, pre_tokenizers

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
SPECIAL_TOKENS_FILE = "special_tokens.json"  # in a checkpoint whose tokenizer lmfoundry did not train


@dataclass(frozen=True)
class SpecialTokens:
    """What a checkpoint's special tokens mean: `eos` ends a document (and a generation), `bos`
    and `pad` are what the chat template and batching may use, `stop` are the further tokens that
    end a generation (an end of turn such as <|im_end|> or <|eot_id|>)."""

    eos: str = EOS
    bos: str | None = None
    pad: str | None = None
    unk: str | None = None
    stop: tuple[str, ...] = (IM_END,)

    @classmethod
    def of_checkpoint(cls, directory: str | Path) -> SpecialTokens:
        """lmfoundry's own tokens, unless the checkpoint was imported with tokens of its own."""
        path = Path(directory) / SPECIAL_TOKENS_FILE
        return cls.from_json(path.read_text(encoding="utf-8"), path) if path.exists() else cls()

    @classmethod
    def from_json(cls, text: str, path: object = SPECIAL_TOKENS_FILE) -> SpecialTokens:
        data = json.loads(text)
        fields = {"eos": str, "bos": (str, type(None)), "pad": (str, type(None)), "unk": (str, type(None))}
        if not isinstance(data, dict) or set(data) - {*fields, "stop"} or not isinstance(data.get("eos"), str):
            raise ValueError(f"{path}: expected an object with a string 'eos' and optional bos, pad, unk and stop")
        stop = data.get("stop", [])
        if not all(isinstance(data.get(k), t) for k, t in fields.items() if k in data) or not (
            isinstance(stop, list) and all(isinstance(x, str) for x in stop)
        ):
            raise ValueError(f"{path}: bos, pad and unk must be strings or null, stop a list of strings")
        return cls(data["eos"], data.get("bos"), data.get("pad"), data.get("unk"), tuple(stop))

    def to_json(self) -> str:
        return json.dumps({"eos": self.eos, "bos": self.bos, "pad": self.pad, "unk": self.unk, "stop": list(self.stop)})

    def eos_id(self, tok: Tokenizer) -> int:
        token_id = tok.token_to_id(self.eos)
        if token_id is None:
            raise ValueError(f"the tokenizer has no end-of-sequence token {self.eos!r}")
        return token_id

    def stop_ids(self, tok: Tokenizer) -> frozenset[int]:
        """The ids that end a generation: eos and the stop tokens the vocabulary has."""
        ids = (tok.token_to_id(t) for t in (self.eos, *self.stop))
        return frozenset(i for i in ids if i is not None)

    def template_variables(self) -> dict[str, str]:
        """As transformers hands them to a chat template (a Llama template writes {{ bos_token }})."""
        named = {"bos_token": self.bos, "eos_token": self.eos, "pad_token": self.pad, "unk_token": self.unk}
        return {k: v for k, v in named.items() if v is not None}


def eos_id(tok: Tokenizer) -> int:
    token_id = tok.token_to_id(EOS)
    if token_id is None:
        raise ValueError(f"tokenizer has no {EOS} token; it was not trained by lmfoundry")
    return token_id


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """Bytes of UTF-8 text behind each token id (0 for special tokens). In a byte-level BPE every
    character of a token's string stands for exactly one byte."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    special = set(SPECIAL_TOKENS) | {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    lengths = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    for token, token_id in tok.get_vocab().items():
        if token in special:
            continue
        if not set(token) <= alphabet:
            raise ValueError(f"token {token!r} is not byte-level; bits per byte needs a byte-level BPE")
        lengths[token_id] = len(token)
    return lengths


# The most a checkpoint's tokenizer.json may hold (a real one is 2 to 35 MB: Llama 3's 9 MB,
# Gemma 3's 33 MB), and its other text files (the special tokens, the model config).
MAX_TOKENIZER_BYTES = 64 << 20
MAX_TEXT_FILE_BYTES = 1 << 20


def checkpoint_tokenizer(uri: str) -> tuple[str, int, int]:
    """The tokenizer.json text, end-of-sequence id and vocabulary size (the model's, which may
    exceed the tokenizer's) of a checkpoint, each file read checked against the manifest and
    refused unread over its size limit; the weights are neither read nor downloaded."""
    from lmfoundry.model.checkpoint import MODEL_CONFIG, TOKENIZER
    from lmfoundry.platform import checkpoint, storage

    ckpt = checkpoint.resolve(uri)
    manifest = storage.read_json(storage.join(ckpt, checkpoint.CHECKPOINT_MANIFEST), storage.MAX_MANIFEST_BYTES)
    files = checkpoint.checked_files(manifest, ckpt)

    def read(name: str) -> str | None:
        if name not in files:
            return None
        cap = MAX_TOKENIZER_BYTES if name == TOKENIZER else MAX_TEXT_FILE_BYTES
        if files[name]["bytes"] > cap:  # the manifest's word, before any read
            raise ValueError(f"checkpoint {ckpt}: {name} is {files[name]['bytes']:,} bytes; at most {cap:,} allowed")
        try:
            data = storage.read_bytes(storage.join(ckpt, name), limit=cap)
        except ValueError as e:  # larger than its manifest says, or not a file
            raise ValueError(f"checkpoint {ckpt}: {name}: {e}") from None
        if hashlib.sha256(data).hexdigest() != files[name]["sha256"]:
            raise ValueError(f"checkpoint {ckpt}: {name} does not match its checksum (corrupt)")
        return data.decode()

    text = read(TOKENIZER)
    if text is None:
        raise FileNotFoundError(f"checkpoint {uri!r} has no {TOKENIZER}")
    tok = Tokenizer.from_str(text)
    special = read(SPECIAL_TOKENS_FILE)
    special = SpecialTokens.from_json(special, f"{ckpt}/{SPECIAL_TOKENS_FILE}") if special else SpecialTokens()
    model_vocab = json.loads(read(MODEL_CONFIG) or "{}").get("vocab_size", 0)
    return text, special.eos_id(tok), max(tok.get_vocab_size(), model_vocab)
