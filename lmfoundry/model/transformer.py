"""A decoder-only transformer, read top-down: config, helpers, attention, MLP, block, model.

RMSNorm, rotary position embeddings (optionally with Llama 3's frequency scaling), grouped-query
attention through `scaled_dot_product_attention` (flash attention on GPUs) with optional q/k/v
biases (Qwen2) and per-head query/key RMSNorm (Qwen3), SwiGLU MLP or a fine-grained MoE (moe.py),
tied or untied embeddings, optional activation checkpointing per block. The optional parts are
what the imported open-model families need (hf_import.py); all are off by default. Several
documents packed in one row (supervised fine-tuning) attend only within themselves: given
per-token document ids, attention is block-diagonal causal and positions restart per document.
Shapes: B batch, T time, C d_model, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field, model_validator

from lmfoundry.model.moe import MoE, MoEConfig
from lmfoundry.platform.config import StageConfig


class RopeScaling(StageConfig):
    """Llama 3.1's rotary scaling: wavelengths longer than the original context divided by
    `factor`, shorter than original/high_freq_factor kept, those between blended smoothly."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(ge=1)

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling: high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )
        return self


# The longest context a model is built for, and the largest rotary tables: max_seq_len rows of
# head_dim / 2 angles, cos and sin, made when the model is, whatever its weights (2 million
# positions at head_dim 128 take 1 GiB in fp32)
MAX_SEQ_LEN = 1 << 21
MAX_ROTARY_ELEMENTS = MAX_SEQ_LEN * 128


class ModelConfig(StageConfig):
    vocab_size: int = Field(0, ge=0, description="0: taken from the tokenizer at pretraining")
    max_seq_len: int = Field(
        0, ge=0, le=MAX_SEQ_LEN, description="0: taken from the packed sequence length; at most 2,097,152"
    )
    n_layer: int = Field(4, ge=1)
    d_model: int = Field(128, ge=8)
    n_head: int = Field(4, ge=1)
    n_kv_head: int = Field(2, ge=1, description="key/value heads; fewer than n_head is GQA")
    ffn_multiple_of: int = Field(32, ge=1)
    ffn_hidden_size: int = Field(0, ge=0, description="0: derived from d_model (8/3 x, rounded)")
    attention_head_dim: int = Field(0, ge=0, description="0: d_model / n_head")
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = Field(False, description="biases on the query, key and value projections (Qwen2)")
    qk_norm: bool = Field(False, description="RMSNorm over each head's queries and keys before rotary (Qwen3)")
    norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = True
    init_std: float = Field(0.02, gt=0)
    activation_checkpointing: bool = False
    moe: MoEConfig | None = None  # None: every block has a dense SwiGLU MLP
    reward_head: bool = Field(False, description="one score per position instead of next-token logits (reward models)")

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if not self.attention_head_dim and self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for rotary embeddings")
        if self.max_seq_len * self.head_dim > MAX_ROTARY_ELEMENTS:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} x head dim {self.head_dim} is past {MAX_ROTARY_ELEMENTS:,}, "
                "the largest rotary tables lmfoundry builds (2,097,152 positions at head dim 128)"
            )
        if self.reward_head and self.tie_embeddings:
            raise ValueError("reward_head: set tie_embeddings false (a scalar head cannot share the embedding)")
        return self

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.d_model // self.n_head

    @property
    def ffn_hidden(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        # SwiGLU with 2/3 of the classic 4x width keeps the parameter count of a GELU MLP.
        hidden = int(2 * 4 * self.d_model / 3)
        return self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # as Meta's reference code and transformers' _compute_llama3_parameters compute it
    old = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    head_dim: int, max_len: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (T, D/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, heads, T, D); cos, sin: (B or 1, T, D/2), one row of angles per position.
    # Rotate pairs (x1, x2) = the two halves of the head dimension.
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """New positions q (B, H, T, D) against the cache's k, v (B, K, L, D) under mask (B, 1, T, L);
    the whole cache is read, so key/value heads are shared rather than copied. A KVCache may be
    given another function of the same form (the serving engine's decode kernel)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


class KVCache:
    """Preallocated keys and values for `slots` sequences, each filled up to its own length.

    A forward pass names the slots its batch rows belong to, so a continuous-batching server
    keeps one slot per running request, decodes rows of different lengths in one pass, and hands
    a finished request's slot to the next one with `reset`."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device, dtype, attention=cached_attention):
        shape = (cfg.n_layer, slots, cfg.n_kv_head, max_len, cfg.head_dim)
        self.attention = attention  # (q, k, v, mask) -> output, as cached_attention
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)  # positions filled per slot
        self.max_len = max_len

    def reset(self, slots: torch.Tensor | list[int]) -> None:
        self.lengths[torch.as_tensor(slots, device=self.lengths.device)] = 0

    @staticmethod
    def rows(slots: torch.Tensor) -> torch.Tensor | slice:
        """How to read the batch's slots: a slice (a view, no copy) when they are consecutive."""
        first, n = int(slots[0]), slots.numel()
        if int(slots[-1]) - first + 1 == n and (n == 1 or bool((slots.diff() == 1).all())):
            return slice(first, first + n)
        return slots

    def update(
        self,
        layer: int,
        slots: torch.Tensor,
        rows: torch.Tensor | slice,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, K, T, D) at `positions` (B, T) of `slots` (B,); return each row's keys
        and values (B, K, L, D) up to the longest row's last position L - 1."""
        # Two advanced indices around a slice put their (B, T) dims first: (B, T, K, D).
        self.k[layer][slots[:, None], :, positions] = k.transpose(1, 2)
        self.v[layer][slots[:, None], :, positions] = v.transpose(1, 2)
        end = int(positions.max()) + 1
        return self.k[layer][rows, :, :end], self.v[layer][rows, :, :end]


def document_positions_and_mask(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of packed documents, doc_ids (B, T): each token's position within its document
    (B, T) and the attention mask (B, 1, T, T), causal within a document and closed across."""
    B, T = doc_ids.shape
    index = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # each token's document start
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return index - first, (same & causal)[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=cfg.attention_bias)
        self.wkv = nn.Linear(cfg.d_model, 2 * cfg.n_kv_head * cfg.head_dim, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, cached: tuple | None = None, mask: torch.Tensor | None = None):
        """cached: (cache, slots (B,), rows, positions (B, T), mask (B, 1, T, L)) when decoding;
        mask (B, 1, T, T): which keys each query sees, for packed documents (else causal)."""
        D = self.cfg.head_dim
        # Head counts and the sequence length come from the projections' outputs, not from the
        # config or x: under tensor parallelism each rank's projections hold a slice of the heads,
        # and under sequence parallelism x holds a slice of the sequence that the projections
        # gather whole (train/tensor_parallel.py).
        q = self.wq(x)
        B, T = q.shape[:2]
        q = q.view(B, T, -1, D)
        k, v = self.wkv(x).view(B, T, 2, -1, D).unbind(2)  # 2 x (B, T, K, D)
        H, K = q.shape[2], k.shape[2]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H or K, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cached is None:
            if K != H:
                k = k.repeat_interleave(H // K, dim=1)
                v = v.repeat_interleave(H // K, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        else:
            cache, slots, rows, positions, mask = cached
            k, v = cache.update(self.layer, slots, rows, positions, k, v)  # (B, K, L, D)
            y = cache.attention(q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * D))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        moe = cfg.moe is not None and layer >= cfg.moe.first_dense_layers
        self.mlp = MoE(cfg.d_model, cfg.ffn_hidden, cfg.moe, cfg.init_std) if moe else SwiGLU(cfg)

    def forward(self, x, cos, sin, cached=None, mask=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cached, mask)
        return x + self.mlp(self.mlp_norm(x))


def build_on_meta(cfg: ModelConfig) -> Transformer:
    """The model with every parameter and buffer on the meta device (shapes, no storage: a model
    of any size), torch's global generator left as it was."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return Transformer(cfg)


def _normal(shape: tuple[int, ...], std: float, seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(shape) if out is None else out
    return out.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))


def _read_float(weights, name: str) -> torch.Tensor:
    return weights.get_tensor(name).float()


def _rows_of(value: Callable[[], torch.Tensor], rows: slice, out: torch.Tensor | None = None) -> torch.Tensor:
    part = value()[rows]
    return part if out is None else out.copy_(part)


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of `module` that its state holds (a checkpoint writes them): each MoE layer's
    aux-free routing bias; not the rotary tables, which are rebuilt."""
    kept = {}
    for name, buffer in module.named_buffers():
        owner, _, attr = name.rpartition(".")
        if attr not in module.get_submodule(owner)._non_persistent_buffers_set:
            kept[name] = buffer
    return kept


def _filled(shape: tuple[int, ...], value: float, out: torch.Tensor | None = None) -> torch.Tensor:
    return torch.full(shape, value) if out is None else out.fill_(value)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size < 1 or cfg.max_seq_len < 1:
            raise ValueError(
                f"vocab_size ({cfg.vocab_size}) and max_seq_len ({cfg.max_seq_len}) must be set "
                "before building the model"
            )
        self.cfg = cfg
        # Each parameter's initial value is a function of this seed and of the parameter's name
        # alone, never of the order in which parameters are drawn: a model built on the meta
        # device and split over tensor-parallel ranks materialises each rank's slice of exactly
        # the values a whole build holds (train/meta_init.py). Drawn from torch's global generator
        # (so `torch.manual_seed(s)` before building still decides the weights) before any layer's
        # own default init draws from it (which it does on the CPU, not on the meta device).
        self.init_seed = int(torch.randint(2**62, (), device="cpu"))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # a reward model's output layer is a scalar head in place of the vocabulary projection
        self.lm_head = nn.Linear(cfg.d_model, 1 if cfg.reward_head else cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # The training loss, given targets, when set (Hugging Face's hook name): a vocabulary-
        # parallel head's logits are each rank's slice of the vocabulary, and DeepSpeed puts a
        # distributed cross-entropy here (train/tensor_parallel.py). Called with the logits and
        # `shift_labels`, targets that are already the next tokens.
        self.loss_function = None
        # A model built on the meta device to continue training from a checkpoint takes its
        # initial values from there: an open safetensors file (keys(), get_slice(), get_tensor())
        # holding this model's state (model/checkpoint.py load_model_on_meta)
        self.start_weights = None
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_parameters()

    def _init_parameters(self) -> None:
        """Every parameter not on the meta device set to its initial value (in place: no copy)."""
        values = self.initial_values()
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not p.is_meta:
                    values[name](out=p)

    def initial_values(self) -> dict[str, Callable[..., torch.Tensor]]:
        """For each parameter's name, a function that makes its whole initial value (fp32, on the
        CPU, or written into `out=`): normal with `init_std` for linear, embedding and expert
        weights, GPT-2's scaled std for the projections that write into the residual stream,
        zeros for biases, ones for norms. Read the shapes from the model before anything splits
        it, except an MoE layer's experts split by expert parallelism: each of its routed-expert
        tensors is the whole layer's value cut to the experts this model holds. Each normal value
        draws from a generator of its own, seeded by a hash of the model's `init_seed` and the
        parameter's name; torch's CPU generator keeps 32 bits of a seed, so
        the few names whose 32 bits collide get the next free seed, in name order (the same in
        every build of one config)."""
        if self.start_weights is not None:
            return self._start_values()
        values, seeds = {}, set()
        for name, p in sorted(self.named_parameters()):
            owner, _, attr = name.rpartition(".")
            module = self.get_submodule(owner)
            shape = tuple(p.shape)
            if isinstance(module, RMSNorm):
                values[name] = functools.partial(_filled, shape, 1.0)
            elif attr == "bias":
                values[name] = functools.partial(_filled, shape, 0.0)
            elif isinstance(module, (nn.Linear, nn.Embedding)) or (isinstance(module, MoE) and attr.startswith("w_")):
                std = self.cfg.init_std
                if name.endswith(("wo.weight", "w_down.weight", "mlp.w_down", "shared_down.weight")):
                    std /= math.sqrt(2 * self.cfg.n_layer)
                key = f"{self.init_seed}:{name}".encode()
                seed = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
                while seed in seeds:
                    seed = (seed + 1) % 2**32
                seeds.add(seed)
                rows = self._own_experts(name)
                if rows is None:
                    values[name] = functools.partial(_normal, shape, std, seed)
                else:  # the whole layer's value, drawn as one, cut to the experts this model holds
                    whole = (self.cfg.moe.num_experts, *shape[1:])
                    values[name] = functools.partial(_rows_of, functools.partial(_normal, whole, std, seed), rows)
            else:
                raise ValueError(f"no initial value is defined for parameter {name!r} of {type(module).__name__}")
        return values

    def _start_values(self) -> dict[str, Callable[..., torch.Tensor]]:
        """initial_values read from `start_weights`, one tensor at a time (as fp32); the file
        must hold exactly this model's state (a tied head stored once, as the embedding), each
        tensor in its parameter's shape."""
        weights = self.start_weights
        params = dict(self.named_parameters())
        expected = {**params, **persistent_buffers(self)}
        stored = set(weights.keys())
        missing, unexpected = sorted(set(expected) - stored), sorted(stored - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"the checkpoint's weights do not fit its model config: missing {missing}, unexpected {unexpected}"
            )
        for name, p in expected.items():
            shape = tuple(weights.get_slice(name).get_shape())
            expected_shape = tuple(p.shape)
            rows = self._own_experts(name)
            if rows is not None:  # the checkpoint holds every expert; this model some of them
                expected_shape = (self.cfg.moe.num_experts, *expected_shape[1:])
            if shape != expected_shape:
                raise ValueError(f"the checkpoint's {name} has shape {shape}; its model config makes {expected_shape}")

        def read(name: str, out: torch.Tensor | None = None) -> torch.Tensor:
            # a split layer's experts read whole and cut, as its random initial values are drawn
            # (an adapter checkpoint's weights read only whole: its merge is by whole tensors)
            rows = self._own_experts(name)
            value = weights.get_tensor(name).float()
            value = value if rows is None else value[rows]
            return value if out is None else out.copy_(value)

        return {name: functools.partial(read, name) for name in params}

    def _own_experts(self, name: str) -> slice | None:
        """For a routed-expert tensor of an MoE layer whose experts were split from outside
        (train/expert_parallel.py), the rows of the whole layer's this model holds; else None."""
        owner, _, attr = name.rpartition(".")
        module = self.get_submodule(owner) if owner else self
        if not isinstance(module, MoE) or attr not in ("w_gate_up", "w_down") or module.ep_size == 1:
            return None
        local = module.cfg.num_experts // module.ep_size
        return slice(module.ep_rank * local, (module.ep_rank + 1) * local)

    def initial_buffers(self) -> dict[str, Callable[[], torch.Tensor]]:
        """For a model built on the meta device, each persistent buffer's value (fp32, on the
        CPU): the start checkpoint's, else its initial zeros."""
        weights = self.start_weights
        return {
            name: (
                functools.partial(_read_float, weights, name)
                if weights is not None
                else functools.partial(_filled, tuple(b.shape), 0.0)
            )
            for name, b in persistent_buffers(self).items()
        }

    def reset_buffers(self) -> None:
        """The buffers a model built on the meta device needs before it can run, made on the CPU:
        the rotary tables built again, and each persistent buffer still on the meta device (an
        MoE layer's routing bias) given its initial value (initial_buffers)."""
        self.rope_cos, self.rope_sin = rope_tables(
            self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.cfg.rope_scaling
        )
        values = self.initial_buffers()
        for name, buffer in persistent_buffers(self).items():
            if buffer.is_meta:
                owner, _, attr = name.rpartition(".")
                setattr(self.get_submodule(owner), attr, values[name]())

    def untie_head(self) -> None:
        """Give a tied model's output head a weight of its own, starting as the embedding's values
        (the config says so too, so the model saves and exports as untied)."""
        if not self.cfg.tie_embeddings:
            raise ValueError("untie_embeddings: the model's head and embedding are untied already")
        self.cfg = self.cfg.model_copy(update={"tie_embeddings": False})
        self.lm_head.weight = nn.Parameter(self.embed.weight.detach().clone(), self.embed.weight.requires_grad)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx: (B, T) token ids. Returns logits (B, T, V) and, given targets, the mean loss.
        With a cache, row b continues the sequence in cache slot `slots[b]` (default: slot b).
        logits_at (B,): the logits of row b at position logits_at[b] only, as (B, 1, V): a
        prefill needs no more than its prompts' last positions, and the output layer over every
        position is a fifth of a prefill's work at the serving benchmark's shapes.
        doc_ids (B, T): the document each token belongs to, for rows that pack several documents
        (each document's tokens contiguous): a token attends only to earlier tokens of its own
        document, and its position counts from its document's first token, so each document's
        logits are what it would get alone."""
        B, T = idx.shape
        mask = None
        if logits_at is not None and targets is not None:
            raise ValueError("logits_at and targets exclude each other: the loss needs every position's logits")
        cached = None
        if cache is None:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
            cos, sin = self.rope_cos[None, :T], self.rope_sin[None, :T]
            if doc_ids is not None:
                positions, mask = document_positions_and_mask(doc_ids)
                cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        else:
            if doc_ids is not None:
                raise ValueError("doc_ids is for training on packed rows, not for decoding with a cache")
            if slots is None:
                slots = torch.arange(B, device=idx.device)
            positions = cache.lengths[slots][:, None] + torch.arange(T, device=idx.device)  # (B, T)
            end = int(positions.max()) + 1
            if end > min(self.cfg.max_seq_len, cache.max_len):
                raise ValueError(
                    f"sequence of {end} tokens exceeds max_seq_len={self.cfg.max_seq_len} "
                    f"or the cache's {cache.max_len}"
                )
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            # Each query sees the keys of its own slot up to its own position.
            mask = torch.arange(end, device=idx.device)[None, None, None, :] <= positions[:, None, :, None]
            cached = (cache, slots, KVCache.rows(slots), positions, mask)
        x = self.embed(idx)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training and cache is None:
                # recompute the block in backward instead of keeping its activations
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, None, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, cached, mask)
        if cache is not None:
            cache.lengths[slots] += T
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at][:, None]
        logits = self.lm_head(self.norm(x))
        loss = None
        if targets is not None:
            if self.loss_function is not None:
                loss = self.loss_function(logits.float(), shift_labels=targets)
            else:
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
            if self.training:
                loss = loss + sum((m.aux_loss for m in self.moe_layers()), loss.new_zeros(()))
        return logits, loss

    def moe_layers(self) -> list[MoE]:
        return [b.mlp for b in self.blocks if isinstance(b.mlp, MoE)]
