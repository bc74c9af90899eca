"""Where each of our tensors lives in a Hugging Face checkpoint of a given architecture, and how
it is cut or joined on the way: one table that import (hf_import.py) reads one way and export
(export.py) the other, so the two cannot drift apart.

Our attention fuses key and value (`wkv`), our MLP gate and up (`w_gate_up`); routed experts are
stacked as (E, C, 2H) and (E, H, C) where Hugging Face checkpoints keep one (H, C) / (C, H)
matrix per expert, as `nn.Linear` stores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lmfoundry.model.transformer import ModelConfig

# the Hugging Face `model_type`s we read or write
Arch = Literal["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "glm4_moe"]

Kind = Literal["same", "rows", "expert_gate_up", "expert_down", "zeros", "double"]


@dataclass(frozen=True)
class Mapped:
    """ours = f(theirs): "same" (one tensor), "rows" (theirs concatenated along dim 0),
    "expert_gate_up" (theirs = gate_0, up_0, gate_1, ...: stacked (E, C, 2H)), "expert_down"
    (theirs = down_0, down_1, ...: stacked (E, H, C)), "zeros" (not in their checkpoint: a
    buffer of `shape` that is zero there), "double" (theirs is twice ours: Qwen2-MoE's shared
    expert sits behind a sigmoid gate that we export as sigmoid(0) = 1/2)."""

    ours: str
    theirs: tuple[str, ...]
    kind: Kind = "same"
    shape: tuple[int, ...] = ()


def _expert_names(arch: Arch, prefix: str, n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    gate_up = tuple(f"{prefix}experts.{e}.{w}.weight" for e in range(n) for w in (gate, up))
    return gate_up, tuple(f"{prefix}experts.{e}.{down}.weight" for e in range(n))


def layout(cfg: ModelConfig, arch: Arch) -> list[Mapped]:
    """Every tensor of our state dict (the tied head aside) and its source in `arch`."""
    out = [Mapped("embed.weight", ("model.embed_tokens.weight",)), Mapped("norm.weight", ("model.norm.weight",))]
    if not cfg.tie_embeddings:
        out.append(Mapped("lm_head.weight", ("lm_head.weight",)))
    for i in range(cfg.n_layer):
        o, t = f"blocks.{i}.", f"model.layers.{i}."
        a = t + "self_attn."
        out += [
            Mapped(o + "attn_norm.weight", (t + "input_layernorm.weight",)),
            Mapped(o + "mlp_norm.weight", (t + "post_attention_layernorm.weight",)),
            Mapped(o + "attn.wq.weight", (a + "q_proj.weight",)),
            Mapped(o + "attn.wkv.weight", (a + "k_proj.weight", a + "v_proj.weight"), "rows"),
            Mapped(o + "attn.wo.weight", (a + "o_proj.weight",)),
        ]
        if cfg.attention_bias:
            out += [
                Mapped(o + "attn.wq.bias", (a + "q_proj.bias",)),
                Mapped(o + "attn.wkv.bias", (a + "k_proj.bias", a + "v_proj.bias"), "rows"),
            ]
        if cfg.qk_norm:
            out += [Mapped(o + "attn.q_norm.weight", (a + "q_norm.weight",))]
            out += [Mapped(o + "attn.k_norm.weight", (a + "k_norm.weight",))]
        m = cfg.moe
        if m is None or i < m.first_dense_layers:
            p = t + "mlp."
            out += [
                Mapped(o + "mlp.w_gate_up.weight", (p + "gate_proj.weight", p + "up_proj.weight"), "rows"),
                Mapped(o + "mlp.w_down.weight", (p + "down_proj.weight",)),
            ]
            continue
        p = t + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        gate_up, down = _expert_names(arch, p, m.num_experts)
        out += [
            Mapped(o + "mlp.router.weight", (p + "gate.weight",)),
            Mapped(o + "mlp.w_gate_up", gate_up, "expert_gate_up"),
            Mapped(o + "mlp.w_down", down, "expert_down"),
        ]
        if arch == "glm4_moe":
            out.append(Mapped(o + "mlp.expert_bias", (p + "gate.e_score_correction_bias",)))
        else:
            out.append(Mapped(o + "mlp.expert_bias", (), "zeros", (m.num_experts,)))
        if m.num_shared_experts:
            s = p + ("shared_experts." if arch == "glm4_moe" else "shared_expert.")
            out.append(Mapped(o + "mlp.shared_gate_up.weight", (s + "gate_proj.weight", s + "up_proj.weight"), "rows"))
            kind = "double" if arch == "qwen2_moe" else "same"
            out.append(Mapped(o + "mlp.shared_down.weight", (s + "down_proj.weight",), kind))
    return out


# --- their tensors -> ours (import) -----------------------------------------------------------


def our_shape(entry: Mapped, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of our tensor, from the shapes of its sources."""
    if entry.kind == "zeros":
        return entry.shape
    if entry.kind == "rows":
        if any(s[1:] != shapes[0][1:] for s in shapes):
            raise ValueError(f"{entry.theirs}: shapes {shapes} cannot be stacked along their rows")
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    if entry.kind == "expert_gate_up":
        if len(set(shapes)) != 1 or len(shapes[0]) != 2:
            raise ValueError(f"{entry.theirs[0]}...: expert gate/up shapes {sorted(set(shapes))} differ")
        hidden, d_model = shapes[0]
        return (len(shapes) // 2, d_model, 2 * hidden)
    if entry.kind == "expert_down":
        if len(set(shapes)) != 1 or len(shapes[0]) != 2:
            raise ValueError(f"{entry.theirs[0]}...: expert down shapes {sorted(set(shapes))} differ")
        d_model, hidden = shapes[0]
        return (len(shapes), hidden, d_model)
    return shapes[0]


def join(entry: Mapped, theirs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Our tensor from its sources (which the caller read for `entry.theirs`)."""
    if entry.kind == "zeros":
        return torch.zeros(entry.shape, dtype=dtype)
    if entry.kind == "rows":
        return torch.cat([t.to(dtype) for t in theirs], dim=0)
    if entry.kind == "expert_gate_up":
        pairs = zip(theirs[0::2], theirs[1::2], strict=True)
        return torch.stack([torch.cat([g.to(dtype).T, u.to(dtype).T], dim=1) for g, u in pairs])
    if entry.kind == "expert_down":
        return torch.stack([d.to(dtype).T for d in theirs])
    if entry.kind == "double":
        return theirs[0].to(dtype) / 2
    return theirs[0].to(dtype)


# --- our tensor -> theirs (export) ------------------------------------------------------------


def split(entry: Mapped, ours: torch.Tensor) -> list[torch.Tensor]:
    """The sources of `entry` from our tensor, in the order of `entry.theirs`."""
    if entry.kind == "zeros":
        return []
    if entry.kind == "rows":
        return list(ours.chunk(len(entry.theirs), dim=0))
    if entry.kind == "expert_gate_up":
        hidden = ours.shape[2] // 2
        return [w.T for e in range(ours.shape[0]) for w in (ours[e, :, :hidden], ours[e, :, hidden:])]
    if entry.kind == "expert_down":
        return [ours[e].T for e in range(ours.shape[0])]
    if entry.kind == "double":
        return [ours * 2]
    return [ours]


def their_shapes(entry: Mapped, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes `split` returns, from our tensor's shape alone."""
    if entry.kind == "zeros":
        return []
    if entry.kind == "rows":
        return [(shape[0] // len(entry.theirs), *shape[1:])] * len(entry.theirs)
    if entry.kind == "expert_gate_up":
        experts, d_model, two_hidden = shape
        return [(two_hidden // 2, d_model)] * (2 * experts)
    if entry.kind == "expert_down":
        experts, hidden, d_model = shape
        return [(d_model, hidden)] * experts
    return [shape]
