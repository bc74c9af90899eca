"""Import a local Hugging Face checkpoint (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Mixtral,
Qwen3-MoE) as an lmfoundry checkpoint, its tokenizer, chat template and special tokens included.

The config is translated field by field; a field whose value our model does not compute (a
sliding window inside the context, an unknown RoPE scaling, partial rotary, biases where our
attention has none, ...) is refused with its name and the supported values, never dropped.
The weights are streamed: each of our tensors is built from its sources (hf_layout.py), read
from their shard with `safe_open`, and written straight to the output file, so the import
holds one tensor at a time, not the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE, ChatTemplate, ChatTemplateError
from lmfoundry.model.checkpoint import MODEL_CONFIG, TOKENIZER, WEIGHTS
from lmfoundry.model.hf_layout import Arch, layout, our_shape
from lmfoundry.model.hf_layout import join as join_tensors
from lmfoundry.model.moe import MoEConfig
from lmfoundry.model.tensor_files import SafetensorsDir, read_source_file, write_safetensors
from lmfoundry.model.tokenizer import SPECIAL_TOKENS_FILE, SpecialTokens
from lmfoundry.model.transformer import MAX_SEQ_LEN, ModelConfig, RopeScaling

FAMILIES: dict[str, str] = {  # model_type -> the architecture its config.json names
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
ROPE_TYPES = ("default", "llama3")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _refuse(field: str, value, supported: str) -> ValueError:
    return ValueError(f"config.json: {field}={value!r} is not supported; supported: {supported}")


def _count(hf: dict, field: str, default: int | None = None, high: int | None = None) -> int:
    """A positive integer field of config.json (a count or a size), checked before any arithmetic."""
    value = hf.get(field)
    if value is None:
        if default is None:
            raise ValueError(f"config.json lacks the field {field!r}")
        return default
    if type(value) is not int or value < 1 or (high is not None and value > high):
        raise _refuse(field, value, f"an integer from 1 to {high:,}" if high else "a positive integer")
    return value


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters`; older configs have `rope_theta` and `rope_scaling`
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise _refuse("rope_parameters", params, "an object with rope_type and rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _refuse("rope_parameters.rope_type", rope_type, ", ".join(ROPE_TYPES))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", params["partial_rotary_factor"], "1.0 (rotary over the whole head)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    try:
        scaling = RopeScaling(
            factor=params["factor"],
            low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position_embeddings=params["original_max_position_embeddings"],
        )
    except KeyError as e:
        raise ValueError(f"config.json: rope_type llama3 needs rope_parameters.{e.args[0]}") from None
    return theta, scaling


def _sliding_window(hf: dict, arch: str) -> int | None:
    """The window the source model attends within, None when it attends to everything."""
    layer_types = hf.get("layer_types") or []
    if isinstance(layer_types, list) and "sliding_attention" in layer_types:
        return None if hf.get("sliding_window") is None else _count(hf, "sliding_window")
    if arch in ("mistral", "mixtral") or hf.get("use_sliding_window"):
        window = hf.get("sliding_window")
        return None if window is None else _count(hf, "sliding_window")
    return None


def _moe(hf: dict, arch: str) -> MoEConfig | None:
    if arch == "mixtral":
        return MoEConfig(
            num_experts=_count(hf, "num_local_experts"),
            top_k=_count(hf, "num_experts_per_tok"),
            expert_hidden=_count(hf, "intermediate_size"),
            num_shared_experts=0,
            score_func="softmax",
            normalize_topk=True,
            aux_loss_coef=hf.get("router_aux_loss_coef", 0.02),
        )
    if arch == "qwen3_moe":
        if hf.get("decoder_sparse_step", 1) != 1:
            raise _refuse("decoder_sparse_step", hf["decoder_sparse_step"], "1 (every layer after the dense ones MoE)")
        dense = hf.get("mlp_only_layers") or []
        integers = isinstance(dense, list) and all(type(i) is int for i in dense)
        if not integers or sorted(dense) != list(range(len(dense))):
            raise _refuse("mlp_only_layers", dense, "the leading layers [0, 1, ..., k-1] or []")
        return MoEConfig(
            num_experts=_count(hf, "num_experts" if "num_experts" in hf else "num_local_experts"),
            top_k=_count(hf, "num_experts_per_tok"),
            expert_hidden=_count(hf, "moe_intermediate_size"),
            num_shared_experts=0,
            score_func="softmax",
            normalize_topk=bool(hf.get("norm_topk_prob", False)),
            aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
            first_dense_layers=len(dense),
        )
    return None


def model_config_from_hf(hf: dict, weights: SafetensorsDir, max_seq_len: int | None = None) -> ModelConfig:
    """Our ModelConfig for a Hugging Face `config.json`, refusing what it cannot compute."""
    arch = hf.get("model_type")
    if arch not in FAMILIES:
        raise _refuse("model_type", arch, ", ".join(FAMILIES))
    architectures = hf.get("architectures") or [FAMILIES[arch]]
    if architectures != [FAMILIES[arch]]:
        raise _refuse("architectures", architectures, f"[{FAMILIES[arch]!r}] for model_type {arch}")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", hf["hidden_act"], "silu")
    if hf.get("mlp_bias"):
        raise _refuse("mlp_bias", True, "false")
    if arch != "qwen2" and hf.get("attention_bias"):
        # Llama's and Qwen3's attention_bias puts a bias on the output projection too
        raise _refuse("attention_bias", True, f"false for {arch} (q/k/v biases: Qwen2)")
    theta, scaling = _rope(hf)
    if max_seq_len is not None:
        context = _count({"max_seq_len": max_seq_len}, "max_seq_len", high=MAX_SEQ_LEN)
    else:
        context = _count(hf, "max_position_embeddings", high=MAX_SEQ_LEN)
    window = _sliding_window(hf, arch)
    if window is not None and window < context:
        raise ValueError(
            f"config.json: sliding_window={window} is inside the context of {context} tokens, and lmfoundry "
            "attends to the whole context; supported: sliding_window null or at least the context "
            f"(import with a max_seq_len of at most {window} to use this model within its window)"
        )
    d_model, n_head, vocab = _count(hf, "hidden_size"), _count(hf, "num_attention_heads"), _count(hf, "vocab_size")
    head_dim = _count(hf, "head_dim", default=max(d_model // n_head, 1))
    embed = weights.shape("model.embed_tokens.weight")
    if embed != (vocab, d_model):
        raise ValueError(f"model.embed_tokens.weight is {embed}, config.json says ({vocab}, {d_model})")
    tied = hf.get("tie_word_embeddings")
    if tied is None:
        tied = "lm_head.weight" not in weights
    moe = _moe(hf, arch)
    return ModelConfig(
        vocab_size=vocab,
        max_seq_len=context,
        n_layer=_count(hf, "num_hidden_layers"),
        d_model=d_model,
        n_head=n_head,
        n_kv_head=_count(hf, "num_key_value_heads", default=n_head),
        attention_head_dim=0 if head_dim * n_head == d_model else head_dim,
        ffn_hidden_size=_count(hf, "intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(tied),
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        moe=moe,
    )


def _token(value) -> str | None:
    # tokenizer_config.json writes a special token as a string or as {"content": ...}
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(src: Path, tok_config: dict) -> str:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if not isinstance(template, str) and (text := read_source_file(src, CHAT_TEMPLATE_FILE)) is not None:
        template = text.decode("utf-8")
    if not isinstance(template, str) or not template.strip():
        raise ValueError(
            f"{src}: no chat template (neither tokenizer_config.json's chat_template nor {CHAT_TEMPLATE_FILE}); "
            "serving and fine-tuning render chats with the model's own template"
        )
    return template


def _special_tokens(src: Path, tok_config: dict, tok: Tokenizer) -> SpecialTokens:
    named = {k: _token(tok_config.get(f"{k}_token")) for k in ("eos", "bos", "pad", "unk")}
    for key, token in named.items():
        if token is not None and tok.token_to_id(token) is None:
            raise ValueError(f"tokenizer_config.json: {key}_token {token!r} is not in tokenizer.json's vocabulary")
    stop: list[str] = []
    generation = _read_json(src / "generation_config.json", required=False)
    if generation is not None:  # instruct models stop at an end of turn as well as at eos
        eos_ids = generation.get("eos_token_id")
        for token_id in eos_ids if isinstance(eos_ids, list) else [eos_ids]:
            if isinstance(token_id, int) and (token := tok.id_to_token(token_id)) is not None:
                stop.append(token)
    if named["eos"] is None:
        if not stop:
            raise ValueError(
                "no end-of-sequence token: tokenizer_config.json has no eos_token, generation_config.json no eos_token_id"
            )
        named["eos"] = stop[0]
    return SpecialTokens(
        eos=named["eos"], bos=named["bos"], pad=named["pad"], unk=named["unk"], stop=tuple(dict.fromkeys(stop))
    )


def _read_json(path: Path, required: bool = True) -> dict | None:
    text = read_source_file(path.parent, path.name)
    if text is None:
        if not required:
            return None
        raise FileNotFoundError(f"{path.parent} has no {path.name}; a Hugging Face checkpoint directory needs one")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def import_hf(
    src: str | Path, out: str | Path, max_seq_len: int | None = None, dtype: str = "auto"
) -> tuple[ModelConfig, dict]:
    """Write the lmfoundry checkpoint files of the Hugging Face checkpoint `src` into `out`
    (the caller seals it). dtype "auto" keeps each tensor's own. Returns the model config and
    what the manifest should record of the source."""
    src, out = Path(src), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    hf = _read_json(src / "config.json")
    tok_config = _read_json(src / "tokenizer_config.json")
    tokenizer_json = read_source_file(src, "tokenizer.json")
    if tokenizer_json is None:
        raise FileNotFoundError(f"{src} has no tokenizer.json (a fast tokenizer); lmfoundry reads only that format")
    try:
        tok = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except Exception as e:  # the parser's words, and which file
        raise ValueError(f"{src}/tokenizer.json is not a tokenizers JSON file: {str(e)[:200]}") from None
    template = _chat_template(src, tok_config)
    special = _special_tokens(src, tok_config, tok)
    try:  # compiles and renders a one-message chat, or says why not, before any weight is read
        ChatTemplate(template, special).render([{"role": "user", "content": "Hello"}])
    except ChatTemplateError as e:
        raise ValueError(f"{src}: {e} (a chat of one user message)") from None
    weights = SafetensorsDir(src)
    try:
        cfg = model_config_from_hf(hf, weights, max_seq_len)
    except KeyError as e:
        raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None
    arch: Arch = hf["model_type"]
    # counts from config.json size the tensor table: check them against the tensors first
    last = f"model.layers.{cfg.n_layer - 1}.input_layernorm.weight"
    if last not in weights or f"model.layers.{cfg.n_layer}.input_layernorm.weight" in weights:
        raise ValueError(f"config.json: num_hidden_layers={cfg.n_layer} does not match the checkpoint's layers")
    if cfg.moe is not None:
        moe = "block_sparse_moe." if arch == "mixtral" else "mlp."
        expert = f"model.layers.{cfg.n_layer - 1}.{moe}gate.weight"
        # the whole shape: a router of (experts, 0) would hold no bytes for any number of experts
        if expert not in weights or weights.shape(expert) != (cfg.moe.num_experts, cfg.d_model):
            raise ValueError(f"config.json: {cfg.moe.num_experts} experts do not match the router {expert}")

    entries = layout(cfg, arch)
    specs = []
    for e in entries:
        shapes = [weights.shape(name) for name in e.theirs]
        source_dtype = weights.dtype(e.theirs[0]) if e.theirs else torch.float32
        # the aux-free selection bias stays float32, as training keeps it
        target = torch.float32 if e.ours.endswith("expert_bias") else DTYPES[dtype] or source_dtype
        specs.append((e.ours, target, our_shape(e, shapes)))
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(
            f"tokenizer.json has {tok.get_vocab_size()} tokens, the model's vocab_size is {cfg.vocab_size}"
        )
    used = {name for e in entries for name in e.theirs}
    # a tied head's copy, and the rotary frequencies older checkpoints saved (we recompute them)
    ignored = {"lm_head.weight"} | {n for n in weights.file_of if n.endswith("rotary_emb.inv_freq")}
    if unused := sorted(set(weights.file_of) - used - ignored):
        raise ValueError(f"{src}: tensors this model config has no place for: {unused[:5]}{' ...' * (len(unused) > 5)}")

    out.mkdir(parents=True, exist_ok=True)
    tensors = (join_tensors(e, weights.get(list(e.theirs)), dtype) for e, (_, dtype, _) in zip(entries, specs))
    write_safetensors(out / WEIGHTS, specs, tensors)
    (out / MODEL_CONFIG).write_text(cfg.model_dump_json(indent=2))
    (out / TOKENIZER).write_bytes(tokenizer_json)  # the bytes parsed above, not the file again
    (out / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    (out / SPECIAL_TOKENS_FILE).write_text(special.to_json())
    source = {
        "model_type": arch,
        "architectures": hf.get("architectures"),
        "source_dtype": str(hf.get("dtype", hf.get("torch_dtype"))),
    }
    return cfg, source
