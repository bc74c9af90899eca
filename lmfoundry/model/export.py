"""Export a checkpoint to the Hugging Face format of an existing architecture, so that
`transformers` loads it with no custom code and vLLM can serve it.

Dense models map one to one onto Llama (`LlamaForCausalLM`): same RMSNorm, the same rotate-half
rotary embedding, grouped-query attention, SwiGLU. Our fused projections are split: `wkv` into
`k_proj` / `v_proj`, `w_gate_up` into `gate_proj` / `up_proj`.

MoE models map onto Mixtral (`MixtralForCausalLM`, Llama attention plus routed SwiGLU experts)
when their routing is Mixtral's: softmax scores with the top-k weights renormalised
(`normalize_topk: true`), no shared experts, every layer MoE (`first_dense_layers: 0`), and no
aux-free selection bias. Those are the exact constraints; other MoE configs are refused rather
than exported to an architecture that would compute something else. (The nearest fits for the
rest: Qwen2-MoE gates its shared expert with a sigmoid we do not have; DeepSeek-V3 has the
shared experts, sigmoid scores and selection bias but multi-head latent attention instead of GQA.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmfoundry.model.chat_template import ChatTemplate
from lmfoundry.model.checkpoint import TOKENIZER, load_model_files
from lmfoundry.model.moe import MoE
from lmfoundry.model.tokenizer import EOS
from lmfoundry.model.transformer import Transformer


def llama_config(model: Transformer, eos_id: int | None) -> dict:
    c = model.cfg
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.ffn_hidden,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
    }


def mixtral_constraints(model: Transformer) -> list[str]:
    """Why this MoE model cannot be written as Mixtral; empty when it can."""
    m = model.cfg.moe
    problems = []
    if m.score_func != "softmax" or not m.normalize_topk:
        problems.append("routing must be softmax with normalize_topk: true")
    if m.num_shared_experts:
        problems.append("num_shared_experts must be 0")
    if m.first_dense_layers:
        problems.append("first_dense_layers must be 0")
    if m.balance == "aux_free" and any(float(layer.expert_bias.abs().max()) > 0 for layer in model.moe_layers()):
        problems.append("the aux-free selection bias must be zero")
    return problems


def mixtral_config(model: Transformer, eos_id: int | None) -> dict:
    m = model.cfg.moe
    return {
        **llama_config(model, eos_id),
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": model.moe_layers()[0].expert_hidden,
        "num_local_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "router_aux_loss_coef": m.aux_loss_coef,
        "output_router_logits": False,
        "sliding_window": None,
    }


def llama_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    c = model.cfg
    kv = c.n_kv_head * c.head_dim
    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    if not c.tie_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for i, b in enumerate(model.blocks):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": b.attn_norm.weight,
            p + "post_attention_layernorm.weight": b.mlp_norm.weight,
            p + "self_attn.q_proj.weight": b.attn.wq.weight,
            p + "self_attn.k_proj.weight": b.attn.wkv.weight[:kv],
            p + "self_attn.v_proj.weight": b.attn.wkv.weight[kv:],
            p + "self_attn.o_proj.weight": b.attn.wo.weight,
        }
        if isinstance(b.mlp, MoE):
            # Mixtral's per-expert layout: w1 gate (H, C), w3 up (H, C), w2 down (C, H)
            H = b.mlp.expert_hidden
            q = p + "block_sparse_moe."
            out[q + "gate.weight"] = b.mlp.router.weight
            for e in range(b.mlp.cfg.num_experts):
                out[q + f"experts.{e}.w1.weight"] = b.mlp.w_gate_up[e, :, :H].T
                out[q + f"experts.{e}.w3.weight"] = b.mlp.w_gate_up[e, :, H:].T
                out[q + f"experts.{e}.w2.weight"] = b.mlp.w_down[e].T
        else:
            gate, up = b.mlp.w_gate_up.weight.chunk(2, dim=0)
            out |= {
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": b.mlp.w_down.weight,
            }
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def export_hf(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `config.json`, `model.safetensors`, the tokenizer and `generation_config.json`."""
    checkpoint_dir, out = Path(checkpoint_dir), Path(out_dir)
    model = load_model_files(checkpoint_dir)
    if model.cfg.moe is not None and (problems := mixtral_constraints(model)):
        raise ValueError(
            "this MoE checkpoint cannot be exported as Mixtral without changing its outputs: " + "; ".join(problems)
        )
    out.mkdir(parents=True, exist_ok=True)
    tok_json = json.loads((checkpoint_dir / TOKENIZER).read_text())
    eos_id = next((t["id"] for t in tok_json.get("added_tokens", []) if t["content"] == EOS), None)
    config = mixtral_config(model, eos_id) if model.cfg.moe is not None else llama_config(model, eos_id)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(llama_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(checkpoint_dir / TOKENIZER, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "bos_token": EOS,
                "model_max_length": model.cfg.max_seq_len,
                "clean_up_tokenization_spaces": False,
                "chat_template": ChatTemplate.from_checkpoint(checkpoint_dir).source,
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "bos_token_id": eos_id}))
    return out
