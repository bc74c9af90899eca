"""The Hugging Face export loads in `transformers` with no custom code and gives our logits."""

import subprocess
import sys

import pytest
import torch

from lmfoundry.data.tokenizer import train_bpe
from lmfoundry.model.checkpoint import TOKENIZER, save_model_files
from lmfoundry.model.moe import MoEConfig
from lmfoundry.model.transformer import ModelConfig, Transformer
from lmfoundry.platform import checkpoint

TEXT = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.", "Ünïcödé ✓"] * 20


def make_checkpoint(path, **model_kw):
    torch.manual_seed(0)
    tok = train_bpe(TEXT, vocab_size=300)
    model = Transformer(
        ModelConfig(
            vocab_size=tok.get_vocab_size(), max_seq_len=64, n_layer=2, d_model=64, n_head=4, n_kv_head=2, **model_kw
        )
    ).eval()
    save_model_files(model, path)
    (path / TOKENIZER).write_text(tok.to_str())
    checkpoint.seal(path, {"step": 0})
    return model, tok


@pytest.mark.parametrize("tie", [True, False])
def test_hf_export_logits_match_ours(tmp_path, tie):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = make_checkpoint(tmp_path / "ckpt", tie_embeddings=tie)
    cli = [sys.executable, "-m", "lmfoundry.platform.cli", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]
    r = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    x = torch.randint(0, model.cfg.vocab_size, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[0], atol=1e-4, rtol=1e-4)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok("def add(a, b):")["input_ids"] == tok.encode("def add(a, b):").ids
    # transformers renders chats with the checkpoint's template exactly as the server does
    from lmfoundry.model.chat_template import ChatTemplate

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Call f"},
    ]
    for tools in ([], [tool]):
        ours = ChatTemplate.from_checkpoint(tmp_path / "ckpt").render(messages, tools)
        theirs = hf_tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
        assert theirs == ours


def test_moe_export_as_mixtral_logits_match_ours(tmp_path):
    from transformers import AutoModelForCausalLM

    from lmfoundry.jobs.export import main

    moe = MoEConfig(num_experts=4, top_k=2, num_shared_experts=0, normalize_topk=True, expert_hidden=32)
    model, _ = make_checkpoint(tmp_path / "ckpt", moe=moe)
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    x = torch.randint(0, model.cfg.vocab_size, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "moe, reason",
    [
        (MoEConfig(num_experts=4, top_k=2), "normalize_topk"),
        (MoEConfig(num_experts=4, top_k=2, normalize_topk=True, num_shared_experts=1), "num_shared_experts"),
        (
            MoEConfig(num_experts=4, top_k=2, normalize_topk=True, num_shared_experts=0, first_dense_layers=1),
            "first_dense_layers",
        ),
    ],
)
def test_moe_configs_mixtral_cannot_express_are_refused_with_the_reason(tmp_path, capsys, moe, reason):
    from lmfoundry.jobs.export import main

    make_checkpoint(tmp_path / "ckpt", moe=moe)
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert reason in capsys.readouterr().err
