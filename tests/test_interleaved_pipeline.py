"""The interleaved pipeline's order of work (train/pipeline_schedule.py): every stage runs each
chunk's forward and backward of every micro-batch once, a forward before its backward; the
stages' orders run to the end together with asynchronous sends and blocking receives; the
bubble is the planner's (p - 1) / (v * m + p - 1); and a config that cannot run it is refused by
name. Its losses against one worker's are in tests/test_model_parallel.py."""

import itertools

import pytest

from lmfoundry.planner.search import bubble_fraction
from lmfoundry.train.config import PretrainConfig
from lmfoundry.train.pipeline_schedule import BACKWARD, FORWARD, interleaved_order, simulate


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


def test_the_first_stage_holds_fewer_whole_micro_batches_than_its_chunks_suggest():
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
