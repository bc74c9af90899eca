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

    from lmfoundry.platform.cli import main

    model, tok = make_checkpoint(tmp_path / "ckpt", tie_embeddings=tie)
    argv = ["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]
    if tie:  # the command itself, once; in process otherwise (a fresh interpreter costs seconds)
        r = subprocess.run([sys.executable, "-m", "lmfoundry.platform.cli", *argv], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    else:
        assert main(argv) == 0
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
        (MoEConfig(num_experts=4, top_k=2, num_shared_experts=0), "normalize_topk"),
        (MoEConfig(num_experts=4, top_k=2, score_func="sigmoid", num_shared_experts=0), "num_shared_experts"),
        (
            MoEConfig(num_experts=4, top_k=2, normalize_topk=True, num_shared_experts=0, first_dense_layers=1),
            "first_dense_layers",
        ),
        (MoEConfig(num_experts=4, top_k=2, capacity_factor=1.0), "capacity_factor"),
    ],
)
def test_moe_configs_no_stock_architecture_computes_are_refused_with_the_reason(tmp_path, capsys, moe, reason):
    from lmfoundry.jobs.export import main

    make_checkpoint(tmp_path / "ckpt", moe=moe)
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert reason in capsys.readouterr().err


def glm4_style_moe(**kw):
    # the DeepSeek-V3 design: sigmoid scores, aux-free selection bias, shared experts, a leading dense layer
    return MoEConfig(
        num_experts=8, top_k=2, num_shared_experts=2, expert_hidden=32, score_func="sigmoid", balance="aux_free", **kw
    )


@pytest.mark.parametrize(
    "moe, arch, model_kw",
    [
        (glm4_style_moe(first_dense_layers=1), "Glm4MoeForCausalLM", {}),
        (MoEConfig(num_experts=4, top_k=2, num_shared_experts=2, first_dense_layers=1), "Qwen2MoeForCausalLM", {}),
    ],
)
def test_fine_grained_moe_exports_to_a_stock_architecture_with_our_logits(tmp_path, moe, arch, model_kw):
    from transformers import AutoModelForCausalLM

    from lmfoundry.jobs.export import main

    model, _ = make_checkpoint(tmp_path / "ckpt", moe=moe, tie_embeddings=False, **model_kw)
    # a trained selection bias (what aux-free balancing leaves behind) must survive the export
    if moe.balance == "aux_free":
        for i, layer in enumerate(model.moe_layers()):
            layer.expert_bias.copy_(torch.linspace(-0.2, 0.3, moe.num_experts) * (i + 1))
        save_model_files(model, tmp_path / "ckpt")
        checkpoint.seal(tmp_path / "ckpt", {"step": 0})
    argv = [str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max-shard-size", "100KB"]
    assert main(argv) == 0
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()  # sharded past the size
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == arch
    x = torch.randint(0, model.cfg.vocab_size, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[0], atol=1e-4, rtol=1e-4)


def test_bf16_export_is_bf16_and_an_imported_family_exports_as_itself(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lmfoundry.jobs.export import main

    model, _ = make_checkpoint(tmp_path / "ckpt", qk_norm=True, attention_head_dim=32)
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    x = torch.randint(0, model.cfg.vocab_size, (2, 48))
    with torch.no_grad():  # bf16 rounding of the weights: close, not equal
        torch.testing.assert_close(hf(x).logits, model(x)[0], atol=3e-2, rtol=3e-2)
