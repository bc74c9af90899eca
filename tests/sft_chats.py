"""The sample conversations (every role, tools and tool calls) the SFT tests train on, and the
small random chat model they fine-tune."""

from pathlib import Path

from lmfoundry.data.sample_chats import WEATHER, write_chats

__all__ = ["WEATHER", "build_chat_checkpoint", "write_chats"]


def build_chat_checkpoint(directory: Path, texts: list[str], copyable: bool = False) -> str:
    """A sealed 2-layer random model at `directory`, with a 512-token BPE trained on `texts` and
    lmfoundry's chat template (whose own markup the BPE also learns)."""
    import torch

    from lmfoundry.data.tokenizer import train_bpe
    from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE, DEFAULT_CHAT_TEMPLATE
    from lmfoundry.model.checkpoint import TOKENIZER, save_model_files
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.platform import checkpoint

    tok = train_bpe(list(texts) + [DEFAULT_CHAT_TEMPLATE] * 20, 512, copyable=copyable)
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(vocab_size=tok.get_vocab_size(), max_seq_len=256, n_layer=2, d_model=64, n_head=4, n_kv_head=2)
    )
    save_model_files(model, directory)
    (directory / TOKENIZER).write_text(tok.to_str())
    (directory / CHAT_TEMPLATE_FILE).write_text(DEFAULT_CHAT_TEMPLATE)
    checkpoint.seal(directory, {"step": 0})
    return str(directory)
