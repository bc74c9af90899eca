"""A fine-grained mixture-of-experts layer (the DeepSeekMoE design), single-device.

Many small routed experts plus always-on shared experts; top-k routing with softmax or sigmoid
scores; load balancing by an auxiliary loss or by the auxiliary-loss-free per-expert bias
(which steers selection only and is updated from the observed load); dropless by default, an
optional capacity factor. Shapes: N tokens, C d_model, E routed experts, K top-k, H expert hidden.

Dispatch sorts the N*K (token, expert) assignments by expert so that each expert's tokens are
contiguous, runs the experts' products over those contiguous rows, and adds the results back
weighted by the router. No Python loop ever runs over tokens. Three ways to run the products:
- grouped_mm: gather all N*K rows, one grouped matrix product per projection (GPUs);
- fused (CPUs): one autograd node that takes a chunk of experts at a time, gathers its rows, runs
  both projections and adds the weighted result back before the next chunk, so no (N*K, C) tensor
  is ever allocated, and of what it computes only the (N*K, 2H) pre-activations are kept for
  backward (first derivatives only);
- sliced: gather all rows, one dense product per expert's slice (where grouped_mm is missing).
Expert parallelism (train/expert_parallel.py) exchanges the gathered rows, so it runs grouped_mm
or sliced whatever the setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field, model_validator

from lmfoundry.platform.config import StageConfig

Dispatch = Literal["auto", "grouped_mm", "fused", "sliced"]


class MoEConfig(StageConfig):
    num_experts: int = Field(16, ge=1, description="routed experts")
    num_shared_experts: int = Field(1, ge=0, description="experts every token passes through")
    top_k: int = Field(2, ge=1)
    expert_hidden: int = Field(0, ge=0, description="0: the dense SwiGLU width divided by top_k (fine-grained)")
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    # renormalise the top-k softmax weights to sum to 1 (Mixtral); sigmoid weights always are
    normalize_topk: bool = False
    # aux_free is DeepSeek-V3's method and is meant for sigmoid scores: with softmax, the scores of
    # the losing experts are too close together for a fixed-size bias step to settle
    balance: Literal["aux_loss", "aux_free", "none"] = "aux_loss"
    aux_loss_coef: float = Field(0.01, ge=0)
    bias_update_rate: float = Field(1e-3, ge=0, description="aux_free: bias step per update")
    capacity_factor: float | None = Field(None, gt=0, description="None: dropless")
    first_dense_layers: int = Field(0, ge=0, description="leading layers that keep a dense MLP")
    # auto: fused on CPUs, grouped_mm where the device has it, else sliced
    dispatch: Dispatch = "auto"

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        return self


@dataclass
class RouterStats:
    tokens_per_expert: torch.Tensor  # (E,) assignments per expert in this forward
    dropped: int  # assignments over capacity (0 when dropless)

    @property
    def imbalance(self) -> float:
        """Max over mean load: 1.0 is perfectly even."""
        load = self.tokens_per_expert.float()
        return float(load.max() / load.mean().clamp(min=1e-9))


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.zeros(4, 16, device=device, dtype=dtype)
        w = torch.zeros(2, 16, 16, device=device, dtype=dtype)
        torch._grouped_mm(x, w, offs=torch.tensor([2, 4], device=device, dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _aligned(x: torch.Tensor, w: torch.Tensor) -> bool:
    # torch._grouped_mm needs 16-byte aligned data and row strides, and rejects an empty input
    # (which an expert-parallel rank receives when no token picked its experts); a weight that is
    # a view into an optimizer's flat buffer can start at any 4-byte offset. The strides are the
    # tensors' own: a one-row slice of a wider tensor counts as contiguous and keeps its stride
    strides = (x.stride(0) * x.element_size(), *(s * w.element_size() for s in w.stride()[:-1]))
    return (
        x.shape[0] > 0
        and w.shape[-1] * w.element_size() % 16 == 0
        and all(s % 16 == 0 for s in strides)
        and x.data_ptr() % 16 == 0
        and w.data_ptr() % 16 == 0
    )


def expert_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: list[int], how: str) -> torch.Tensor:
    """x: (M, A) rows sorted by expert; w: (E, A, B); offsets: (E,) int32 cumulative row ends."""
    if how == "grouped_mm":
        xc = x.contiguous()
        if _aligned(xc, w):
            return torch._grouped_mm(xc, w, offs=offsets)
    # one dense product per expert over its contiguous slice of rows (a loop over experts,
    # never over tokens); unbind, not w[e], so backward stacks E gradients instead of
    # accumulating E full-size zero tensors
    return torch.cat([xe @ we for xe, we in zip(torch.split(x, counts), w.unbind(0))], dim=0)


class _GatherRows(torch.autograd.Function):
    """x[index] (rows), by index_select into an output allocated here: on CPUs index_select is
    faster writing into an output allocated beforehand than into one it allocates itself. The
    gradient is _SumRows (and _SumRows' is this), so both differentiate to any order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return torch.index_select(x, 0, index, out=x.new_empty((index.numel(), *x.shape[1:])))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return _SumRows.apply(grad, index, ctx.rows), None


class _SumRows(torch.autograd.Function):
    """The rows of y added into `rows` rows at `index` (index_add into zeros)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return y.new_zeros((rows, *y.shape[1:])).index_add_(0, index, y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return _GatherRows.apply(grad.contiguous(), index), None, None


# The fused dispatch takes about this many elements of rows per chunk (4,096 rows at C = 512,
# 8 MiB in fp32): the elementwise work is one op over thousands of rows, and the chunk buffers
# stay below glibc's largest mmap threshold (32 MiB), so they are reused from the heap rather
# than faulted in as fresh zeroed pages on every pass (benchmarks/moe_layer.py, glibc defaults).
CHUNK_ELEMENTS = 1 << 21


def expert_chunks(counts: list[int], max_rows: int) -> list[tuple[int, int, int, int]]:
    """Consecutive experts grouped into chunks of at most max_rows rows (an expert with more rows
    is a chunk of its own): [(first expert, end expert, first row, end row)], covering every
    expert, each with at least one."""
    chunks, first, start, rows = [], 0, 0, 0
    for e, m in enumerate(counts):
        if e > first and rows + m > max_rows:
            chunks.append((first, e, start, start + rows))
            first, start, rows = e, start + rows, 0
        rows += m
    chunks.append((first, len(counts), start, start + rows))
    return chunks


def _each_expert(a: torch.Tensor, w: torch.Tensor, counts: list[int], experts: range, out: torch.Tensor, t: bool):
    """out[rows of e] = a[rows of e] @ w[e] (w[e].T when t) for each expert e, whose rows are
    contiguous and in order in a and out."""
    start = 0
    for e in experts:
        if m := counts[e]:
            torch.mm(a[start : start + m], w[e].t() if t else w[e], out=out[start : start + m])
        start += m
    return out


def _each_expert_grad(a: torch.Tensor, b: torch.Tensor, counts: list[int], experts: range, out: torch.Tensor):
    """out[e] = a[rows of e].T @ b[rows of e] for each expert e; zero for an expert with no rows."""
    start = 0
    for e in experts:
        if m := counts[e]:
            torch.mm(a[start : start + m].t(), b[start : start + m], out=out[e])
        else:
            out[e].zero_()
        start += m


class _FusedExperts(torch.autograd.Function):
    """out (N, C) = sum over the M assignments a of w_a * down_e(silu(gate_e(x_t)) * up_e(x_t)),
    e and t the assignment's expert and token. token (M,) and row_weights (M, 1) are sorted by
    expert, counts (E,) the rows per expert. Saves x, the weights, token, row_weights and the
    (M, 2H) pre-activations; backward gathers each chunk's rows again. First derivatives only."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, row_weights, token, counts: list[int]):
        N, C = x.shape
        H = w_down.shape[1]
        chunks = expert_chunks(counts, max(1, CHUNK_ELEMENTS // C))
        widest = max(end - start for _, _, start, end in chunks)
        rows, ys = x.new_empty(widest, C), x.new_empty(widest, C)
        pre = x.new_empty(token.numel(), 2 * H)
        out = x.new_zeros(N, C)
        for first, last, start, end in chunks:
            if end == start:
                continue
            index = token[start:end]
            xs = torch.index_select(x, 0, index, out=rows[: end - start])
            experts = range(first, last)
            _each_expert(xs, w_gate_up, counts, experts, pre[start:end], t=False)
            gate, up = pre[start:end].chunk(2, dim=-1)
            # weighted here rather than after the down projection: the same result, a quarter of
            # the work when H = C/4
            hidden = F.silu(gate).mul_(up).mul_(row_weights[start:end])
            out.index_add_(0, index, _each_expert(hidden, w_down, counts, experts, ys[: end - start], t=False))
        ctx.save_for_backward(x, w_gate_up, w_down, row_weights, token, pre)
        ctx.counts, ctx.chunks = counts, chunks
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w_gate_up, w_down, row_weights, token, pre = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: this backward is not differentiable itself
            raise RuntimeError(
                "the fused MoE dispatch has first derivatives only; set model.moe.dispatch to grouped_mm "
                "or sliced to differentiate a gradient"
            )
        # a frozen part (LoRA freezes the experts and the router) costs no work
        need_x, need_gate_up, need_down, need_weights = ctx.needs_input_grad[:4]
        counts, chunks = ctx.counts, ctx.chunks
        grad = grad.contiguous()
        C, H = x.shape[1], w_down.shape[1]
        widest = max(end - start for _, _, start, end in chunks)
        rows, grad_rows = x.new_empty(widest, C), x.new_empty(widest, C)
        d_hidden_buf, d_pre_buf = x.new_empty(widest, H), x.new_empty(widest, 2 * H)
        dx = torch.zeros_like(x) if need_x else None
        d_gate_up = torch.empty_like(w_gate_up) if need_gate_up else None
        d_down = torch.empty_like(w_down) if need_down else None
        d_row_weights = torch.empty_like(row_weights) if need_weights else None
        # every chunk, those with no rows too: they write the zero gradients of their experts
        for first, last, start, end in chunks:
            n, experts, index = end - start, range(first, last), token[start:end]
            g = torch.index_select(grad, 0, index, out=grad_rows[:n])
            gate, up = pre[start:end].chunk(2, dim=-1)
            act = F.silu(gate)
            hidden = act * up  # before the routing weight
            weight = row_weights[start:end]
            if need_down:
                _each_expert_grad(hidden * weight, g, counts, experts, d_down)
            if not (need_weights or need_gate_up or need_x):
                continue
            d_hidden = _each_expert(g, w_down, counts, experts, d_hidden_buf[:n], t=True)
            if need_weights:
                torch.sum(d_hidden * hidden, -1, keepdim=True, out=d_row_weights[start:end])
            if not (need_gate_up or need_x):
                continue
            d_hidden.mul_(weight)
            d_pre = d_pre_buf[:n]
            torch.ops.aten.silu_backward(d_hidden * up, gate, grad_input=d_pre[:, :H])
            torch.mul(d_hidden, act, out=d_pre[:, H:])
            if need_gate_up:
                xs = torch.index_select(x, 0, index, out=rows[:n])
                _each_expert_grad(xs, d_pre, counts, experts, d_gate_up)
            if need_x:
                # the gathered grad rows are read for the last time above: reuse their buffer
                dx.index_add_(0, index, _each_expert(d_pre, w_gate_up, counts, experts, grad_rows[:n], t=True))
        return dx, d_gate_up, d_down, d_row_weights, None, None


class MoE(nn.Module):
    def __init__(self, d_model: int, dense_hidden: int, cfg: MoEConfig, init_std: float = 0.02):
        super().__init__()
        self.cfg = cfg
        E = cfg.num_experts
        H = cfg.expert_hidden or max(8, 8 * round(dense_hidden / cfg.top_k / 8))
        self.expert_hidden = H
        self.router = nn.Linear(d_model, E, bias=False)
        self.w_gate_up = nn.Parameter(torch.randn(E, d_model, 2 * H) * init_std)  # (E, C, 2H)
        self.w_down = nn.Parameter(torch.randn(E, H, d_model) * init_std)  # (E, H, C)
        S = cfg.num_shared_experts
        self.shared_gate_up = nn.Linear(d_model, 2 * H * S, bias=False) if S else None
        self.shared_down = nn.Linear(H * S, d_model, bias=False) if S else None
        # aux-free balancing: added to the scores for selection only, never to the weights
        self.register_buffer("expert_bias", torch.zeros(E))
        self.aux_loss = torch.zeros(())
        self.stats: RouterStats | None = None
        # expert parallelism, set from outside (train/expert_parallel.py): this rank holds experts
        # [ep_rank * E/ep_size, (ep_rank + 1) * E/ep_size), and `exchange` sends each row to the
        # rank that holds its expert, runs it there (through `_experts`) and brings the result back
        self.ep_group = None
        self.ep_size, self.ep_rank = 1, 0
        self.exchange = None
        # sequence parallelism, set from outside (train/tensor_parallel.py): this rank routes a
        # slice of the batch's tokens, and `balance_over` sums the balance loss's per-expert
        # assignment counts, score sums and token count over the ranks that hold the others
        self.balance_over = None
        self._grouped_mm_support: dict[tuple[str, torch.dtype], bool] = {}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, C) -> expert ids (N, K), routing weights (N, K), scores (N, E)."""
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.cfg.score_func == "softmax" else logits.sigmoid()
        select = scores + self.expert_bias if self.cfg.balance == "aux_free" else scores
        ids = select.topk(self.cfg.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.cfg.score_func == "sigmoid" or self.cfg.normalize_topk:  # make the chosen weights sum to 1
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-9)
        return ids, weights, scores

    def _balance_loss(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # Switch/DeepSeek: E * sum_e f_e * P_e, f_e the share of assignments to e, P_e its mean score
        E = self.cfg.num_experts
        counts = torch.bincount(ids.flatten(), minlength=E).float()
        score_sums = (scores / scores.sum(-1, keepdim=True)).sum(0)
        tokens = torch.tensor(float(ids.shape[0]), device=ids.device)
        if self.balance_over is not None:  # the batch's other tokens are on other ranks
            counts, score_sums, tokens = self.balance_over(counts, score_sums, tokens)
        f = counts / (tokens * ids.shape[1])
        P = score_sums / tokens
        return self.cfg.aux_loss_coef * E * (f * P).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C)
        N, K, E = x.shape[0], self.cfg.top_k, self.cfg.num_experts
        ids, weights, scores = self.route(x)
        self.aux_loss = (
            self._balance_loss(ids, scores) if self.training and self.cfg.balance == "aux_loss" else x.new_zeros(())
        )

        flat_ids = ids.flatten()  # (N*K,) assignment a = token a//K to expert flat_ids[a]
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=E)
        dropped = 0
        if self.cfg.capacity_factor is not None:
            capacity = math.ceil(self.cfg.capacity_factor * N * K / E)
            # rank of each sorted assignment within its expert; those past capacity are dropped
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(N * K, device=x.device) - starts.repeat_interleave(counts)
            keep = rank < capacity
            dropped = int((~keep).sum())
            order = order[keep]
            counts = counts.clamp(max=capacity)
        self.stats = RouterStats(counts.detach().cpu(), dropped)

        token = order // K  # (M,) which token each sorted row belongs to
        row_weights = weights.flatten()[order].unsqueeze(-1).to(x.dtype)  # (M, 1)
        if self.exchange is None and self._pick_dispatch(x) == "fused":
            out = _FusedExperts.apply(x, self.w_gate_up, self.w_down, row_weights, token, counts.tolist())
        else:
            xs = _GatherRows.apply(x, token)  # (M, C)
            if self.exchange is None:
                ys = self._experts(xs, counts, row_weights)
            else:
                ys = self.exchange(self, xs, counts, row_weights)
            out = _SumRows.apply(ys, token, N)
        if self.shared_gate_up is not None:
            g, u = self.shared_gate_up(x).chunk(2, dim=-1)
            out = out + self.shared_down(F.silu(g) * u)
        return out.reshape(shape)

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
        """xs: (M, C) rows sorted by (local) expert, counts: (E_local,) rows per expert,
        row_weights: (M, 1) routing weights. Returns the weighted expert outputs (M, C)."""
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        how = self._pick_rows_dispatch(xs)
        count_list = counts.tolist()
        gate, up = expert_matmul(xs, self.w_gate_up, offsets, count_list, how).chunk(2, dim=-1)
        # the routing weight scales the (M, H) hidden rather than the (M, C) output: the down
        # projection is linear, so the result is the same for a quarter of the work when H = C/4
        return expert_matmul(F.silu(gate) * up * row_weights, self.w_down, offsets, count_list, how)

    def _pick_dispatch(self, x: torch.Tensor) -> str:
        """auto: fused on CPUs, else what `_experts` runs (decided on every forward: a layer
        moved to another device after its first forward must not keep its first choice)."""
        if self.cfg.dispatch != "auto":
            return self.cfg.dispatch
        return "fused" if x.device.type == "cpu" else self._pick_rows_dispatch(x)

    def _pick_rows_dispatch(self, x: torch.Tensor) -> str:
        """How `_experts` runs rows already gathered: grouped_mm or sliced as set, else (auto or
        fused, which gathers its own rows) grouped_mm where the device and dtype have it."""
        if self.cfg.dispatch in ("grouped_mm", "sliced"):
            return self.cfg.dispatch
        key = (x.device.type, x.dtype)
        if key not in self._grouped_mm_support:
            self._grouped_mm_support[key] = grouped_mm_supported(x.device, x.dtype)
        return "grouped_mm" if self._grouped_mm_support[key] else "sliced"

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-free balancing: raise the bias of under-loaded experts, lower over-loaded ones.
        Call after each optimizer step with the load summed over all data-parallel ranks, so
        every rank applies the same update."""
        if self.cfg.balance != "aux_free":
            return
        load = tokens_per_expert.to(self.expert_bias.device).float()
        self.expert_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Slow and obviously correct: every token, one at a time, through its own top-k experts.
    For tests only."""
    flat = x.reshape(-1, x.shape[-1])
    ids, weights, _ = moe.route(flat)
    rows = []
    for n in range(flat.shape[0]):
        y = torch.zeros_like(flat[n])
        for k in range(moe.cfg.top_k):
            e = int(ids[n, k])
            gate, up = (flat[n] @ moe.w_gate_up[e]).chunk(2)
            y = y + weights[n, k].to(y.dtype) * ((F.silu(gate) * up) @ moe.w_down[e])
        if moe.shared_gate_up is not None:
            g, u = moe.shared_gate_up(flat[n]).chunk(2)
            y = y + moe.shared_down(F.silu(g) * u)
        rows.append(y)
    return torch.stack(rows).reshape(x.shape)
