"""Export a checkpoint to the Hugging Face format of a stock architecture, so that
`transformers` loads it with no custom code and vLLM can serve it.

The architecture is the one that computes exactly what our model computes, chosen from the
model config (and, for MoE, the selection bias):

| our model | architecture |
|---|---|
| dense | `LlamaForCausalLM`; with q/k/v biases `Qwen2ForCausalLM`; with QK norm `Qwen3ForCausalLM` |
| MoE, sigmoid routing (shared experts, leading dense layers, aux-free selection bias: the DeepSeek-V3 design) | `Glm4MoeForCausalLM` |
| MoE, softmax, no shared experts, top-k renormalised, every layer MoE | `MixtralForCausalLM` |
| MoE, softmax, with QK norm, no shared experts | `Qwen3MoeForCausalLM` |
| MoE, softmax, with shared experts (the 16B recipe) | `Qwen2MoeForCausalLM` |

Glm4Moe is DeepSeek-V3's MoE (sigmoid scores, a per-expert `e_score_correction_bias` added for
selection only, top-k weights renormalised, shared experts, `first_k_dense_replace` leading
dense layers) on ordinary grouped-query attention; DeepSeek-V3 itself would need multi-head
latent attention. We write it with one expert group, a routed scaling factor of 1, full rotary
and no multi-token-prediction layer. Qwen2-MoE gates its shared expert by sigmoid(w . x): we
write w = 0 and the shared expert's down projection doubled, sigmoid(0) = 1/2, exact in any
float format. What no stock architecture computes (softmax scores with a selection bias, a
capacity factor that drops tokens, ...) is refused with the reason, never exported approximately.
A model imported from Mistral exports as Llama, which computes the same.

Weights are streamed (tensor_files.py): one of our tensors is read, cut into the
architecture's tensors, cast to the dtype asked for and written, so the export never holds more
than that tensor; past `max_shard_bytes` the output is sharded with a
`model.safetensors.index.json`, as `save_pretrained` writes it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lmfoundry.model import lora
from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE, ChatTemplate
from lmfoundry.model.checkpoint import MODEL_CONFIG, TOKENIZER, load_model_files, save_model_files
from lmfoundry.model.hf_layout import Arch, Mapped, layout, split, their_shapes
from lmfoundry.model.tensor_files import INDEX, SINGLE, SafetensorsDir, write_safetensors
from lmfoundry.model.tokenizer import SPECIAL_TOKENS_FILE, SpecialTokens
from lmfoundry.model.transformer import ModelConfig

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_SHARD_BYTES = 2 << 30


def choose_architecture(cfg: ModelConfig, bias_is_zero: bool) -> tuple[Arch | None, list[str]]:
    """The stock architecture that computes what `cfg` does, or None and why not."""
    if cfg.reward_head:
        return None, ["a reward model (reward_head) scores text; it is not a causal language model to export"]
    m = cfg.moe
    if m is None:
        if cfg.qk_norm:
            return ("qwen3", []) if not cfg.attention_bias else (None, ["QK norm with q/k/v biases (no stock model)"])
        return ("qwen2" if cfg.attention_bias else "llama"), []
    problems = []
    if m.capacity_factor is not None:
        problems.append("capacity_factor must be null (stock MoE layers drop no token)")
    if m.score_func == "sigmoid":
        if not m.num_shared_experts:
            problems.append("sigmoid routing exports as Glm4Moe, which needs num_shared_experts >= 1")
        return (None if problems else "glm4_moe"), problems
    if not bias_is_zero:
        problems.append("softmax routing with a nonzero aux-free selection bias (use score_func sigmoid)")
    if m.num_shared_experts:
        if cfg.qk_norm:
            problems.append("softmax routing with shared experts exports as Qwen2-MoE, which has no QK norm")
        return (None if problems else "qwen2_moe"), problems
    if cfg.qk_norm:
        if cfg.attention_bias:
            problems.append("QK norm with q/k/v biases (no stock model)")
        return (None if problems else "qwen3_moe"), problems
    if not m.normalize_topk or m.first_dense_layers or cfg.attention_bias:
        problems.append(
            "softmax routing without shared experts exports as Mixtral: normalize_topk must be true, "
            "first_dense_layers 0 and attention_bias false"
        )
    return (None if problems else "mixtral"), problems


def hf_config(cfg: ModelConfig, arch: Arch, special_ids: dict, dtype: str, expert_hidden: int = 0) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling.model_dump(), "rope_theta": cfg.rope_theta}
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "dtype": dtype,
        **special_ids,
    }
    if arch == "llama":
        config["mlp_bias"] = False
    if arch in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"):
        config |= {"use_sliding_window": False, "sliding_window": None}
    m = cfg.moe
    if m is None:
        return config
    hidden = expert_hidden
    moe = {"num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_coef, "output_router_logits": False}
    if arch == "mixtral":
        return config | moe | {"num_local_experts": m.num_experts, "intermediate_size": hidden}
    moe |= {"moe_intermediate_size": hidden}
    if arch == "glm4_moe":
        rope["partial_rotary_factor"] = 1.0
        return (
            config
            | moe
            | {
                "n_routed_experts": m.num_experts,
                "n_shared_experts": m.num_shared_experts,
                "first_k_dense_replace": m.first_dense_layers,
                "norm_topk_prob": True,
                "routed_scaling_factor": 1.0,
                "n_group": 1,
                "topk_group": 1,
                "use_qk_norm": cfg.qk_norm,
                "partial_rotary_factor": 1.0,
                "num_nextn_predict_layers": 0,
            }
        )
    moe |= {
        "num_experts": m.num_experts,
        "norm_topk_prob": m.normalize_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(m.first_dense_layers)),
    }
    if arch == "qwen2_moe":
        moe |= {"shared_expert_intermediate_size": hidden * m.num_shared_experts, "qkv_bias": cfg.attention_bias}
    return config | moe


def _constant_tensors(cfg: ModelConfig, arch: Arch) -> list[tuple[str, tuple[int, ...]]]:
    """Tensors of the architecture that our model lacks, written as zeros."""
    if arch != "qwen2_moe":
        return []
    first = cfg.moe.first_dense_layers
    return [(f"model.layers.{i}.mlp.shared_expert_gate.weight", (1, cfg.d_model)) for i in range(first, cfg.n_layer)]


def parse_size(text: str) -> int:
    """'2GB', '500MB', '40KB' or a number of bytes."""
    units = {"GB": 1 << 30, "MB": 1 << 20, "KB": 1 << 10, "B": 1}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().isdigit():
            return int(t[: -len(unit)]) * scale
    if t.isdigit():
        return int(t)
    raise ValueError(f"shard size {text!r}; allowed: a number of bytes or one with GB, MB or KB, e.g. 2GB")


def export_hf(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `config.json`, the safetensors weights (sharded past `max_shard_bytes`), the
    tokenizer with its chat template and `generation_config.json`. An adapter checkpoint is
    exported as its base with the adapter merged in."""
    checkpoint_dir, out = Path(checkpoint_dir), Path(out_dir)
    if lora.is_adapter(checkpoint_dir):
        with tempfile.TemporaryDirectory(prefix="lmfoundry-merged-") as merged:
            save_model_files(load_model_files(checkpoint_dir), merged)
            for name in (TOKENIZER, CHAT_TEMPLATE_FILE, SPECIAL_TOKENS_FILE):
                if (checkpoint_dir / name).exists():
                    shutil.copyfile(checkpoint_dir / name, Path(merged) / name)
            return export_hf(merged, out, dtype, max_shard_bytes)
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r}; allowed: {', '.join(EXPORT_DTYPES)}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive (got {max_shard_bytes})")
    cfg = ModelConfig.model_validate(json.loads((checkpoint_dir / MODEL_CONFIG).read_text()))
    weights = SafetensorsDir(checkpoint_dir)
    biases = [n for n in weights.file_of if n.endswith("mlp.expert_bias")]
    bias_is_zero = all(float(t.abs().max()) == 0 for t in weights.get(biases))
    arch, problems = choose_architecture(cfg, bias_is_zero)
    if arch is None:
        raise ValueError("no stock architecture computes this model's outputs: " + "; ".join(problems))

    tok = Tokenizer.from_file(str(checkpoint_dir / TOKENIZER))
    special = SpecialTokens.of_checkpoint(checkpoint_dir)
    eos_id, bos = special.eos_id(tok), special.bos or special.eos
    stop_ids = sorted(special.stop_ids(tok) - {eos_id})
    special_ids = {
        "bos_token_id": tok.token_to_id(bos),
        "eos_token_id": eos_id,
        "pad_token_id": tok.token_to_id(special.pad) if special.pad else None,
    }

    # the routed experts' width, as the model derived it (moe.MoE: expert_hidden or from ffn_hidden)
    downs = sorted(n for n in weights.file_of if n.endswith("mlp.w_down"))  # (E, H, C), MoE layers only
    expert_hidden = weights.shape(downs[0])[1] if downs else 0

    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:  # an earlier export's shards
        stale.unlink(missing_ok=True)
    config = hf_config(cfg, arch, special_ids, dtype, expert_hidden)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(out, layout(cfg, arch), _constant_tensors(cfg, arch), weights, EXPORT_DTYPES[dtype], max_shard_bytes)
    shutil.copyfile(checkpoint_dir / TOKENIZER, out / "tokenizer.json")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": special.eos,
        "bos_token": bos,
        "model_max_length": cfg.max_seq_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": ChatTemplate.from_checkpoint(checkpoint_dir).source,
    }
    tok_config |= {"pad_token": special.pad} if special.pad else {}
    tok_config |= {"unk_token": special.unk} if special.unk else {}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    # generation ends at eos and at the end of a turn, as our engine ends it
    generation = {"bos_token_id": special_ids["bos_token_id"], "eos_token_id": [eos_id, *stop_ids]}
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out


def _write_weights(
    out: Path,
    entries: list[Mapped],
    constants: list[tuple[str, tuple[int, ...]]],
    weights: SafetensorsDir,
    dtype: torch.dtype,
    max_shard_bytes: int,
) -> None:
    # An entry's tensors go to one shard, so each of ours is read once; a shard closes when the
    # next entry would take it past the limit.
    def spec_of(e: Mapped) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        # the selection bias stays float32, as transformers keeps it
        d = torch.float32 if e.ours.endswith("expert_bias") else dtype
        return [(n, d, s) for n, s in zip(e.theirs, their_shapes(e, weights.shape(e.ours)), strict=True)]

    items = [(e, spec_of(e)) for e in entries if e.kind != "zeros"]
    items += [(None, [(name, dtype, shape)]) for name, shape in constants]
    shards: list[list] = [[]]
    size = 0
    for item in items:
        nbytes = sum(torch.Size(s).numel() * d.itemsize for _, d, s in item[1])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes

    def tensors(shard):
        for entry, specs in shard:
            if entry is None:
                yield torch.zeros(specs[0][2], dtype=specs[0][1])
                continue
            (ours,) = weights.get([entry.ours])
            for t, (_, d, _) in zip(split(entry, ours), specs, strict=True):
                yield t.to(d)

    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        names = [SINGLE]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards, strict=True):
        specs = [s for _, item_specs in shard for s in item_specs]
        total += write_safetensors(out / name, specs, tensors(shard))
        weight_map |= {s[0]: name for s in specs}
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2))
