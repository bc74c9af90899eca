"""The interleaved pipeline's order of work (train/pipeline_schedule.py): every stage runs each
chunk's forward and backward of every micro-batch once, a forward before its backward; the
stages' orders run to the end together with asynchronous sends and blocking receives (gloo), and
with NCCL's matching of each pair's transfers in one queue a process group; a send's buffer is
let go only once a later message proves it arrived; the bubble is the planner's
(p - 1) / (v * m + p - 1); and a config that cannot run it is refused by name. Its losses against one worker's are in tests/test_model_parallel.py."""

import itertools

import pytest

from lmfoundry.planner.search import bubble_fraction
from lmfoundry.train.config import PretrainConfig
from lmfoundry.train.pipeline_schedule import (
    BACKWARD,
    FORWARD,
    check_nccl_matching,
    interleaved_order,
    messages,
    release_points,
    simulate,
)


@pytest.mark.parametrize("stages, virtual, groups", itertools.product([2, 3, 4, 8], [1, 2, 3, 4], [1, 2, 3]))
def test_every_stage_runs_each_chunk_of_each_micro_batch_once_and_the_stages_never_wait_for_ever(
    stages, virtual, groups
):
    micro = stages * groups
    for stage in range(stages):
        order = interleaved_order(stages, virtual, micro, stage)
        work = {(c, m) for c in range(virtual) for m in range(micro)}
        assert sorted((c, m) for kind, c, m in order if kind == FORWARD) == sorted(work)
        assert sorted((c, m) for kind, c, m in order if kind == BACKWARD) == sorted(work)
        position = {(kind, c, m): i for i, (kind, c, m) in enumerate(order)}
        assert all(position[(FORWARD, c, m)] < position[(BACKWARD, c, m)] for c, m in work)
    run = simulate(stages, virtual, micro)  # raises if the stages would wait on each other for ever
    # the idle share is the planner's, which the interleaving cuts about v-fold
    assert run["bubble"] == pytest.approx(bubble_fraction(stages, micro, virtual), abs=1e-12)
    # Megatron's warm-up bounds the chunks a stage holds: at most (p - s - 1) * 2 + (v - 1) * p + 1
    for stage, held in enumerate(run["most_held"]):
        assert held <= min(micro * virtual, (stages - stage - 1) * 2 + (virtual - 1) * stages + 1)


def test_interleaving_holds_more_activations_on_the_first_stage_than_1f1b():
    # 4 stages, 2 chunks, 8 micro-batches: stage 0 holds 11 chunks of half a stage's layers at
    # most, 5.5 micro-batches' worth, against 1F1B's 4 whole ones: the memory interleaving costs
    assert simulate(4, 2, 8)["most_held"][0] == 11
    assert simulate(4, 1, 8)["most_held"][0] == 7  # this order's v = 1 warm-up is twice 1F1B's


@pytest.mark.parametrize("micro", [3, 5, 6])
def test_micro_batches_that_are_not_a_multiple_of_the_stages_are_refused_by_name(micro):
    with pytest.raises(ValueError, match=rf"a step's {micro} micro-batches .* must be a multiple of 4"):
        interleaved_order(4, 2, micro, 0)


def _config(**parallelism):
    return {
        "data": "-",
        "output": "-",
        "model": {"vocab_size": 64, "max_seq_len": 16, "n_layer": 4, "d_model": 32, "n_head": 2},
        "parallelism": {"zero_stage": 1, **parallelism},
    }


@pytest.mark.parametrize(
    "parallelism, message",
    [
        ({"num_workers": 2, "virtual_stages": 2}, "virtual_stages=2 needs pipeline_parallel_size > 1"),
        (
            {"num_workers": 2, "pipeline_parallel_size": 2, "virtual_stages": 3},
            r"pipeline_parallel_size=2 x virtual_stages=3 needs at least one block a virtual stage \(6\); "
            "the model has n_layer=4",
        ),
        ({"num_workers": 2, "pipeline_parallel_size": 2, "virtual_stages": 0}, "greater than or equal to 1"),
        ({"num_workers": 2, "pipeline_parallel_size": 2, "virtual_stages": 65}, "less than or equal to 64"),
    ],
)
def test_a_layout_without_a_chunk_for_every_virtual_stage_is_refused_by_name(parallelism, message):
    with pytest.raises(ValueError, match=message):
        PretrainConfig.model_validate(_config(**parallelism))
    assert PretrainConfig.model_validate(_config(num_workers=2, pipeline_parallel_size=2, virtual_stages=2))


@pytest.mark.parametrize("stages, virtual, groups", itertools.product([2, 3, 4, 8], [1, 2, 4], [1, 3, 6]))
def test_the_transfers_match_in_order_where_nccl_queues_each_pair_of_ranks_and_buffers_are_let_go_once_received(
    stages, virtual, groups
):
    micro = stages * groups
    check_nccl_matching(stages, virtual, micro)  # raises on a deadlock or a mismatched receive
    check_nccl_matching(stages, virtual, micro, bound_device=True)
    orders = [interleaved_order(stages, virtual, micro, s) for s in range(stages)]
    received_at = {}  # message -> (stage, op index) that receives it
    for s in range(stages):
        for i, op in enumerate(orders[s]):
            received, _ = messages(stages, virtual, op, s)
            if received is not None:
                received_at[received] = (s, i)
    for s in range(stages):
        released = release_points(stages, virtual, micro, s)
        for j, sends in enumerate(released):
            for i in sends:
                assert i < j
                _, sent = messages(stages, virtual, orders[s][i], s)
                peer, k = received_at[sent]
                # this stage's op j receives something the peer sent from after its op k
                received, _ = messages(stages, virtual, orders[s][j], s)
                sender = received[1] % stages
                assert sender == peer and received_at[received] == (s, j)
                sent_from = next(
                    n for n, op in enumerate(orders[peer]) if messages(stages, virtual, op, peer)[1] == received
                )
                assert sent_from > k
        # the sends left to the step's end are no more than the first stage's warm-up holds,
        # however many micro-batches the step has (the cool-down's, which no message follows)
        left = sum(1 for op in orders[s] if messages(stages, virtual, op, s)[1]) - sum(map(len, released))
        assert left <= (stages - 1) * 2 + (virtual - 1) * stages + 1


def test_one_process_group_a_kind_deadlocks_nccl():
    """What the kind-and-direction groups are for: with one group a kind, two stages' ranks each
    send first and wait on a receive queued behind the other's send; with the group's own
    communicator (a bound device), so do more stages, around the ring."""
    one_a_kind = lambda message, stages: message[0]  # noqa: E731
    with pytest.raises(RuntimeError, match="the transfers deadlock at p=2"):
        check_nccl_matching(2, 2, 4, route=one_a_kind)
    check_nccl_matching(3, 2, 6, route=one_a_kind)  # a pair's queue carries one way from 3 stages on
    with pytest.raises(RuntimeError, match="the transfers deadlock at p=3"):
        check_nccl_matching(3, 2, 6, route=one_a_kind, bound_device=True)


def test_a_step_whose_micro_batches_do_not_fill_the_groups_is_refused_before_the_workers_start():
    from lmfoundry.train.engine import check_every_world_size

    raw = _config(num_workers=2, pipeline_parallel_size=2, virtual_stages=2)
    three = PretrainConfig.model_validate({**raw, "batch": {"micro_batch_size": 2, "global_batch_tokens": 3 * 2 * 16}})
    with pytest.raises(ValueError, match="a step's 3 micro-batches .* must be a multiple of 2"):
        check_every_world_size(three, seq_len=16)
    four = PretrainConfig.model_validate({**raw, "batch": {"micro_batch_size": 2, "global_batch_tokens": 4 * 2 * 16}})
    check_every_world_size(four, seq_len=16)


@pytest.mark.parametrize("stages, virtual, groups", [(2, 2, 2), (3, 2, 1), (4, 3, 2), (8, 2, 1)])
def test_a_released_send_was_received_before_its_release_whatever_the_ops_cost(stages, virtual, groups):
    """Run the orders with each op's cost drawn at random: the receive of every send a stage lets
    go started no later than the op whose message lets it go (the engine waits after that
    message's receive)."""
    import random

    micro = stages * groups
    orders = [interleaved_order(stages, virtual, micro, s) for s in range(stages)]
    received_at = {}
    for s in range(stages):
        for i, op in enumerate(orders[s]):
            received, _ = messages(stages, virtual, op, s)
            if received is not None:
                received_at[received] = (s, i)
    for seed in range(20):
        costs = random.Random(seed)
        drawn = {(s, i): costs.uniform(0.1, 3.0) for s in range(stages) for i in range(len(orders[s]))}
        starts = simulate(stages, virtual, micro, cost=lambda s, i, drawn=drawn: drawn[(s, i)])["starts"]
        for s in range(stages):
            for j, sends in enumerate(release_points(stages, virtual, micro, s)):
                for i in sends:
                    peer, k = received_at[messages(stages, virtual, orders[s][i], s)[1]]
                    assert starts[peer][k] <= starts[s][j], (seed, s, i, j)
