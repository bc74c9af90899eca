"""The order of a pipeline stage's work under interleaved virtual stages (Narayanan et al.
2021, section 2.2; Megatron-LM's `forward_backward_pipelining_with_interleaving`): each of the p
stages holds v chunks of the model's layers instead of one run of them, chunk c of stage s being
virtual stage c * p + s, so a micro-batch goes round the stages v times. The pipeline's bubble
shrinks v-fold, to (p - 1) / (v * m) of a step of m micro-batches, for v times the
point-to-point traffic.

The order is Megatron's: a warm-up of forwards, (p - s - 1) * 2 + (v - 1) * p of them on stage s,
then one forward and one backward in turn, then the remaining backwards. The k-th forward of a
stage runs chunk (k mod p * v) div p on micro-batch (k div p * v) * p + k mod p, and its k-th
backward the chunks in the reverse order, so the micro-batches go through the chunks in groups
of p and a step needs m to be a multiple of p. The engine (train/interleaved_pipeline.py) runs
it with asynchronous sends and blocking receives; that every stage's order then runs to the end,
whatever p, v and m, is what `simulate` checks.

Pure Python, without DeepSpeed, so that a config can be checked without importing it.
"""

from __future__ import annotations

FORWARD, BACKWARD = "forward", "backward"


def check_micro_batches(stages: int, virtual_stages: int, micro_batches: int) -> None:
    if virtual_stages > 1 and micro_batches % stages:
        raise ValueError(
            f"virtual_stages={virtual_stages} runs the micro-batches through the chunks in groups of "
            f"pipeline_parallel_size={stages}: a step's {micro_batches} micro-batches (its gradient "
            f"accumulation) must be a multiple of {stages}"
        )


def interleaved_order(stages: int, virtual_stages: int, micro_batches: int, stage: int) -> list[tuple[str, int, int]]:
    """Stage `stage`'s work for one step, in order: (FORWARD or BACKWARD, chunk, micro-batch)."""
    check_micro_batches(stages, virtual_stages, micro_batches)
    total, group = micro_batches * virtual_stages, stages * virtual_stages

    def forward(k: int) -> tuple[str, int, int]:
        return FORWARD, k % group // stages, k // group * stages + k % stages

    def backward(k: int) -> tuple[str, int, int]:
        return BACKWARD, virtual_stages - 1 - k % group // stages, k // group * stages + k % stages

    warmup = min(total, (stages - stage - 1) * 2 + (virtual_stages - 1) * stages)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    return order + [backward(k) for k in range(total - warmup, total)]


def simulate(stages: int, virtual_stages: int, micro_batches: int) -> dict:
    """Every stage's order run as the engine runs it (a forward waits for the previous virtual
    stage's forward of its micro-batch, a backward for the next one's backward; sends never
    wait), one unit of work at a time on each stage (a backward costing two): raises if the
    stages would wait on each other for ever; else the number of time units the step takes and
    the most micro-batch chunks whose activations a stage holds at once, and the bubble: the
    share of the step each stage is idle."""
    orders = [interleaved_order(stages, virtual_stages, micro_batches, s) for s in range(stages)]
    last = stages * virtual_stages - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, micro-batch) -> time it ended
    position, free_at, held, most_held = [0] * stages, [0] * stages, [0] * stages, [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        ready = []
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            kind, chunk, micro = orders[s][position[s]]
            virtual = chunk * stages + s
            needs = [] if kind == FORWARD and virtual == 0 else [(FORWARD, virtual - 1, micro)]
            if kind == BACKWARD:
                needs = [(FORWARD, virtual, micro)] + ([] if virtual == last else [(BACKWARD, virtual + 1, micro)])
            if all(n in done for n in needs):
                start = max([free_at[s], *(done[n] for n in needs)])
                ready.append((start, s, kind, virtual, micro))
        if not ready:
            raise RuntimeError(f"the interleaved order deadlocks at p={stages} v={virtual_stages} m={micro_batches}")
        start, s, kind, virtual, micro = min(ready)
        free_at[s] = done[(kind, virtual, micro)] = start + (1 if kind == FORWARD else 2)
        position[s] += 1
        held[s] += 1 if kind == FORWARD else -1
        most_held[s] = max(most_held[s], held[s])
    step = max(free_at)
    return {"time": step, "most_held": most_held, "bubble": 1 - micro_batches * virtual_stages * 3 / step}
