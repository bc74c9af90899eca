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
whatever p, v and m, is what `simulate` checks, and `check_nccl_matching` that it does so too
where NCCL matches the transfers between two ranks in one queue for each process group.

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


def simulate(stages: int, virtual_stages: int, micro_batches: int, cost=None) -> dict:
    """Every stage's order run as the engine runs it (a forward waits for the previous virtual
    stage's forward of its micro-batch, a backward for the next one's backward; sends never
    wait), one op at a time on each stage, an op costing `cost(stage, index)` (default: a
    forward one unit, a backward two): raises if the stages would wait on each other for ever;
    else the time the step takes, when each op started (`starts`, by stage), the most
    micro-batch chunks whose activations a stage holds at once, and the bubble: the share of the
    step each stage is idle (with the default costs)."""
    orders = [interleaved_order(stages, virtual_stages, micro_batches, s) for s in range(stages)]
    last = stages * virtual_stages - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, micro-batch) -> time it ended
    position, free_at, held, most_held = [0] * stages, [0] * stages, [0] * stages, [0] * stages
    starts: list[list] = [[] for _ in range(stages)]
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
        took = (1 if kind == FORWARD else 2) if cost is None else cost(s, position[s])
        free_at[s] = done[(kind, virtual, micro)] = start + took
        starts[s].append(start)
        position[s] += 1
        held[s] += 1 if kind == FORWARD else -1
        most_held[s] = max(most_held[s], held[s])
    step = max(free_at)
    bubble = 1 - micro_batches * virtual_stages * 3 / step
    return {"time": step, "starts": starts, "most_held": most_held, "bubble": bubble}


ACTIVATION, GRADIENT = "activation", "gradient"


def messages(stages: int, virtual_stages: int, op: tuple[str, int, int], stage: int) -> tuple:
    """What `op` on `stage` receives before it runs and sends after, each None or (kind, the
    sending virtual stage, micro-batch): a forward takes the previous virtual stage's activations
    and passes its own on, a backward takes the next one's gradient and passes its input's back."""
    kind, chunk, micro = op
    virtual, last = chunk * stages + stage, stages * virtual_stages - 1
    if kind == FORWARD:
        return (
            None if virtual == 0 else (ACTIVATION, virtual - 1, micro),
            None if virtual == last else (ACTIVATION, virtual, micro),
        )
    return (
        None if virtual == last else (GRADIENT, virtual + 1, micro),
        None if virtual == 0 else (GRADIENT, virtual, micro),
    )


def receiving_stage(stages: int, message: tuple) -> int:
    kind, sender, _ = message
    return (sender + (1 if kind == ACTIVATION else -1)) % stages


def transfer_pairs(stages: int, virtual_stages: int) -> list[tuple]:
    """Every (channel, lower stage, higher stage) a step's transfers use, in one order for every rank."""
    pairs = set()
    for stage in range(stages):
        for op in interleaved_order(stages, virtual_stages, stages, stage):
            for message in messages(stages, virtual_stages, op, stage):
                if message is not None:
                    peer = receiving_stage(stages, message)
                    sender = message[1] % stages
                    pairs.add((channel(message, stages), min(sender, peer), max(sender, peer)))
    return sorted(pairs)


def channel(message: tuple, stages: int) -> tuple[str, str]:
    """The process group a message travels in: one for each kind and direction (towards a later
    or an earlier stage). NCCL matches the sends and receives between two ranks of a group in the
    order each rank issues them, one communicator a pair; at two stages activations (within a
    chunk, and from the last stage back to the first between chunks) and gradients both go both
    ways, and with one group a kind the two ranks' sends would each wait on a receive queued
    behind the other's send."""
    kind, sender, _ = message
    return kind, "later" if sender % stages < receiving_stage(stages, message) else "earlier"


def release_points(stages: int, virtual_stages: int, micro_batches: int, stage: int) -> list[list[int]]:
    """For each op of `stage`'s order, the earlier ops whose sends have certainly been received
    once this op's own message has arrived: their buffers can be let go. The peer that received
    send S at its op k had, by then, finished its ops before k (its receives block), so any message
    it sent `stage` from an op after k proves S arrived. Sends no such message covers are waited
    on at the end of the step."""
    orders = [interleaved_order(stages, virtual_stages, micro_batches, s) for s in range(stages)]
    flows = [[messages(stages, virtual_stages, op, s) for op in orders[s]] for s in range(stages)]
    received_at = {flows[s][i][0]: (s, i) for s in range(stages) for i in range(len(orders[s])) if flows[s][i][0]}
    # for each peer: the first op of this stage that receives a message the peer sent from its op k or later
    first_after = {}
    for peer in range(stages):
        first, suffix = len(orders[stage]), []
        for i in reversed(range(len(orders[peer]))):
            sent = flows[peer][i][1]
            if sent is not None and receiving_stage(stages, sent) == stage:
                first = min(first, received_at[sent][1])
            suffix.append(first)
        first_after[peer] = suffix[::-1] + [len(orders[stage])]
    release: list[list[int]] = [[] for _ in orders[stage]]
    for i, (_, sent) in enumerate(flows[stage]):
        if sent is not None:
            peer, k = received_at[sent]
            j = first_after[peer][k + 1]
            if j < len(orders[stage]):
                release[j].append(i)
    return release


def check_nccl_matching(
    stages: int, virtual_stages: int, micro_batches: int, route=channel, bound_device: bool = False
) -> None:
    """Every stage's order run as NCCL runs the engine's transfers: each rank issues all its
    sends and receives at once, in its order, into queues that each run one transfer at a time;
    a transfer runs when it heads its queue on both its ranks, a send once its op has run, and an
    op runs once its message has arrived. PyTorch without a bound device keeps a queue for each
    (group, pair of ranks), a communicator it makes at the pair's first transfer (which the
    engine makes before its first step); with one (`bound_device`), a queue for each (group,
    rank), the group's own communicator. Raises if ranks would wait on each other for ever, or
    if a receive would take another message than its own."""
    orders = [interleaved_order(stages, virtual_stages, micro_batches, s) for s in range(stages)]
    flows = [[messages(stages, virtual_stages, op, s) for op in orders[s]] for s in range(stages)]
    queues: dict[tuple, dict[int, list]] = {}  # queue -> each rank's transfers in it: (sends, message, peer)
    for s in range(stages):
        for received, sent in flows[s]:
            for message, sending in ((received, False), (sent, True)):
                if message is not None:
                    peer = receiving_stage(stages, message) if sending else message[1] % stages
                    group = route(message, stages)
                    key = (group,) if bound_device else (group, min(s, peer), max(s, peer))
                    queues.setdefault(key, {}).setdefault(s, []).append((sending, message, peer))
    arrived, ready, position = set(), set(), [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):  # each rank runs its ops in order, each once its message is in
            while position[s] < len(orders[s]) and (
                flows[s][position[s]][0] is None or flows[s][position[s]][0] in arrived
            ):
                ready.add(flows[s][position[s]][1])  # what it sends can leave
                position[s] += 1
                progressed = True
        for ranks in queues.values():
            for sender, transfers in ranks.items():
                while transfers and transfers[0][0]:  # a send heads the sender's queue
                    _, message, peer = transfers[0]
                    theirs = ranks.get(peer) or [(True, None, None)]
                    receives, expected, source = not theirs[0][0], theirs[0][1], theirs[0][2]
                    if not receives or source != sender:
                        break  # the peer's queue is headed by its own send, or a receive from another
                    if expected != message:
                        raise RuntimeError(f"at p={stages} a receive would take {message} for {expected}")
                    if message not in ready:
                        break
                    arrived.add(message)
                    transfers.pop(0)
                    theirs.pop(0)
                    progressed = True
        if not progressed:
            raise RuntimeError(
                f"the transfers deadlock at p={stages} v={virtual_stages} m={micro_batches}: "
                f"stages stopped at ops {position}"
            )
