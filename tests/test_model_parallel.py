"""Tensor parallelism (train/tensor_parallel.py) and pipeline parallelism
(train/pipeline_parallel.py) train the model the data-parallel run trains: on gloo processes
(benchmarks/harness/model_parallel.py), the losses of 10 steps at TP 2 x DP 2 with a
vocabulary-parallel head (4 workers), PP 2 (2 workers, 4 micro-batches a step), PP 2 x DP 2 (4
workers, activation checkpointing), and with sequence parallelism TP 2 x PP 2 (4 workers, each
stage split over 2, 4 micro-batches a step: the head whole; the tied table split by vocabulary
on both end stages; an untied head and embedding split by vocabulary, with checkpointing), TP 2
x PP 2 with an untied head and embedding split by vocabulary and no sequence split, and
TP 2 with a vocabulary-parallel head and embedding (tied, with checkpointing; untied), and with
4 blocks PP 2 and TP 2 x PP 2 (sequence and vocabulary parallel, with checkpointing), with 8 PP 4,
each with 2 virtual stages on the interleaved schedule, and with 4 blocks of which 3 are MoE layers
PP 2 (the load-balancing loss), PP 2 x DP 2 (aux-free balancing, with checkpointing), PP 2 x DP 2
with each stage's experts split over its 2 replicas, PP 2 x 2 virtual stages (with
checkpointing), and with sequence parallelism and the experts split over each tensor-parallel
group TP 2, TP 2 x DP 2 (with checkpointing) and TP 2 x PP 2 (aux-free balancing), are those of
one worker holding the whole model, each rank
holding its half of every vocabulary table it holds, and the weights each run writes (piece
by piece, or layer by layer from each stage, gathered over its tensor-parallel group) are whole:
loaded into the single-device model they give the engines' logits (a vocabulary-parallel
engine's: rank 0's half of the vocabulary). The untied one-worker run is without ZeRO, whose
gradient norm DeepSpeed does not keep by itself; its norms are held to the untied runs' too. The
tensor-parallel runs without a pipeline move the
activation traffic the planner counts (4 all-reduces a block; 1.25 times that with sequence
parallelism). An MoE run's experts see the same tokens, step by step, as the one worker's: each
layer's load, which the aux-free bias follows, is summed over the ranks that hold the layer and
known on every rank."""

import math
import pickle

import pytest
import torch
import torch.distributed as dist
from harness.model_parallel import SEQ_LEN, compare_layouts, small_config
from harness.peak_memory import spawn_ranks, start_rank


def test_tensor_and_pipeline_parallel_runs_give_the_one_worker_losses_and_whole_weights(deepspeed_processes, tmp_path):
    rows = compare_layouts(str(tmp_path), steps=10)  # the first half of each schedule
    reference = rows["one worker"]["losses"]
    assert reference[-1] < reference[0] - 0.5, reference  # it learns (4.61 to 3.77 when written)
    for name, row in rows.items():
        assert row["loss_max_abs_diff"] <= 1e-4, (name, row["losses"], reference)
        assert row["grad_norm_max_rel_diff"] <= 1e-4, (name, row["grad_norms"])  # clipping sees the whole model
        assert row["reloaded_vs_one_worker_logits"] <= 1e-4, name
        assert row["reloaded_vs_own_engine_logits"] is None or row["reloaded_vs_own_engine_logits"] <= 1e-5, name
        if row["pipeline_stages"] == 1:  # a vocabulary-parallel engine computes its rank's half of the logits
            assert row["engine_logits_width"] == (48 if row.get("vocab_parallel") else 96), name
        # and holds half of each vocabulary table's rows, tied or not, in a pipeline or not: the
        # embedding on a first stage, the head (tied: the embedding's weight) on a last, none between
        table_rows, held = 48 if row.get("vocab_parallel") else 96, row["vocabulary_rows"]
        stages, per_stage = row["pipeline_stages"], row["workers"] // row["pipeline_stages"]
        ends = [rank // per_stage in (0, stages - 1) for rank in range(row["workers"])]
        assert [set(tables) for tables in held] == [{table_rows} if end else set() for end in ends], (name, held)
    assert rows["one worker, untied"]["losses"] != reference  # the untied rows have a reference of their own
    moe = [row for row in rows.values() if row.get("moe")]
    assert {row["name"] for row in moe} == {
        "one worker, MoE",
        "one worker, MoE aux-free",
        "PP 2, MoE",
        "PP 2 x DP 2, MoE aux-free, recompute",
        "PP 2 x EP 2, MoE",
        "PP 2 x 2 virtual stages, MoE, recompute",
        "TP 2, sequence parallel, MoE",
        "TP 2 x DP 2, sequence parallel, MoE, recompute",
        "TP 2 x PP 2, sequence parallel, MoE aux-free",
    }
    for row in moe:
        assert len(row["tokens_per_expert"]) == 10 and len(row["tokens_per_expert"][0]) == 3, row["name"]
        assert row["expert_loads_equal"], row["name"]

    # tensor-parallel traffic of a micro-batch, in all-reduces of one activation, forward and
    # backward. Each of the 2 blocks all-reduces twice forward and twice backward (once per input
    # of column-parallel layers, not once per layer, which would be 3); the vocabulary-parallel
    # embedding all-reduces its output and the head its input's gradient.
    blocks = 2
    assert rows["TP 2 x DP 2, vocab parallel"]["tensor_parallel_all_reduces"] == {
        "forward": 2 * blocks + 1,
        "backward": 2 * blocks + 1,
    }
    # sequence parallelism: 1.25 times that a block (2 all-gathers and 2 reduce-scatters forward;
    # backward 2 all-gathers again, 2 reduce-scatters and 2 all-gathers), plus the reduce-scatter
    # of the vocabulary-parallel embedding's partial lookups into the sequence's slices and the
    # final norm's gather forward, the gather of the slices' gradients and the reduce-scatter of
    # the head's partial input gradients backward (an all-reduce and a slice would count 1, not 0.5)
    sequence_parallel = {"forward": 2 * blocks + 0.5 + 0.5, "backward": 3 * blocks + 0.5 + 0.5}
    assert rows["TP 2, vocab + sequence parallel, untied"]["tensor_parallel_all_reduces"] == sequence_parallel
    # a tied embedding's lookups are reduce-scattered the same way (its recomputed forward adds to backward)
    recomputed = rows["TP 2, vocab + sequence parallel, recompute"]["tensor_parallel_all_reduces"]
    assert recomputed["forward"] == sequence_parallel["forward"]


def test_a_universal_checkpoints_parameters_are_renamed_between_the_model_and_its_pipeline(tmp_path):
    import pytest

    from lmfoundry.model.transformer import ModelConfig
    from lmfoundry.train.checkpointing import _rename_parameters
    from lmfoundry.train.pipeline_parallel import pipeline_parameter_names

    cfg = ModelConfig(vocab_size=32, max_seq_len=8, n_layer=2, d_model=16, n_head=2, n_kv_head=1, tie_embeddings=False)
    names = pipeline_parameter_names(cfg)
    assert names["embed.weight"] == "0.embed.weight" and names["lm_head.weight"] == "4.module.weight"
    assert names["blocks.1.attn.wq.weight"] == "2.block.attn.wq.weight" and names["norm.weight"] == "3.module.weight"
    zero = tmp_path / "zero"
    for name in names:
        (zero / name).mkdir(parents=True)
        (zero / name / "fp32.pt").write_text(name)
    (zero / "optimizer_state.pt").write_text("common")
    _rename_parameters(zero, names, to_pipeline=True)
    assert (zero / "2.block.attn.wq.weight" / "fp32.pt").read_text() == "blocks.1.attn.wq.weight"
    _rename_parameters(zero, names, to_pipeline=False)  # and back
    assert sorted(p.name for p in zero.iterdir()) == sorted([*names, "optimizer_state.pt"])
    (zero / "blocks.7.attn.wq.weight").mkdir()  # a parameter the model does not have
    with pytest.raises(ValueError, match="blocks.7.attn.wq.weight"):
        _rename_parameters(zero, names, to_pipeline=True)
    tied = pipeline_parameter_names(cfg.model_copy(update={"tie_embeddings": True}))
    assert tied["embed.weight"] == "tied_modules.embed.embed.weight" and "lm_head.weight" not in tied


def test_a_blocks_router_loss_gradient_is_the_gradient_of_adding_its_scaled_loss():
    """RouterLossGradient: the activations unchanged, and backward the gradient the loss would
    get were `scale` times it added to the objective, without the loss travelling on."""
    from lmfoundry.train.pipeline_parallel import RouterLossGradient

    torch.manual_seed(0)
    x, w, router = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4), torch.randn(5, requires_grad=True)
    attached = RouterLossGradient.apply(x * 2, (router**2).sum(), 0.25)
    assert torch.equal(attached, x * 2)
    (attached * w).sum().backward()
    grads = x.grad.clone(), router.grad.clone()
    x.grad, router.grad = None, None
    ((x * 2 * w).sum() + 0.25 * (router**2).sum()).backward()
    assert torch.allclose(grads[0], x.grad) and torch.allclose(grads[1], router.grad)


class RunsCode:
    """Pickled, it asks the loader to call a function of its choosing: here, to create `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pipelines_buffers_are_read_from_its_layer_files_and_bad_ones_are_refused_by_name(tmp_path):
    """The routing biases a universal move carries: written from a pipeline's layer files beside
    the parameters' folders, read back into the model; a missing or malformed one is named."""
    from types import SimpleNamespace

    from lmfoundry.model.moe import MoEConfig
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.train.checkpointing import (
        _extract_pipeline_buffers,
        _load_universal_buffers,
        _written_expert_parallel,
    )

    cfg = ModelConfig(vocab_size=32, max_seq_len=8, n_layer=2, d_model=16, n_head=2, n_kv_head=1)
    cfg = cfg.model_copy(update={"moe": MoEConfig(num_experts=4, top_k=2, first_dense_layers=1)})
    state, zero = tmp_path / "state", tmp_path / "zero"
    state.mkdir()
    zero.mkdir()
    bias = torch.tensor([0.5, -0.5, 0.25, 0.0])
    with pytest.raises(ValueError, match="layer_02-model_00-model_states.pt holds no tensor block.mlp.expert_bias"):
        _extract_pipeline_buffers(state, zero, cfg)
    torch.save({"block.mlp.router.weight": torch.zeros(4, 16)}, state / "layer_02-model_00-model_states.pt")
    with pytest.raises(ValueError, match="holds no tensor block.mlp.expert_bias"):
        _extract_pipeline_buffers(state, zero, cfg)
    # a layer file from storage that would run code when unpickled: refused, the code never runs
    ran = tmp_path / "ran"
    torch.save({"block.mlp.expert_bias": RunsCode(ran)}, state / "layer_02-model_00-model_states.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _extract_pipeline_buffers(state, zero, cfg)
    assert not ran.exists()
    torch.save({"block.mlp.expert_bias": bias}, state / "layer_02-model_00-model_states.pt")
    _extract_pipeline_buffers(state, zero, cfg)
    # read back into a model of the same layout, by the pipeline's names (here the model's own)
    model = Transformer(cfg)
    (zero / "2.block.mlp.expert_bias").rename(zero / "blocks.1.mlp.expert_bias")
    _load_universal_buffers(SimpleNamespace(module=model), zero, "ckpt")
    assert torch.equal(model.blocks[1].mlp.expert_bias, bias)
    torch.save({"param": torch.zeros(3)}, zero / "blocks.1.mlp.expert_bias" / "fp32.pt")
    with pytest.raises(ValueError, match="holds 3 values; the model's has 4"):
        _load_universal_buffers(SimpleNamespace(module=model), zero, "ckpt")
    torch.save(["not", "a", "dict"], zero / "blocks.1.mlp.expert_bias" / "fp32.pt")
    with pytest.raises(ValueError, match="blocks.1.mlp.expert_bias holds no tensor"):
        _load_universal_buffers(SimpleNamespace(module=model), zero, "ckpt")
    (zero / "blocks.1.mlp.expert_bias" / "fp32.pt").unlink()
    with pytest.raises(ValueError, match="holds no value for the buffer blocks.1.mlp.expert_bias"):
        _load_universal_buffers(SimpleNamespace(module=model), zero, "ckpt")
    for bad in (0, "2", 2.0, None):
        with pytest.raises(ValueError, match="expert_parallel_size"):
            _written_expert_parallel({"config": {"parallelism": {"expert_parallel_size": bad}}}, "ckpt")
    assert _written_expert_parallel({}, "ckpt") == 1


def test_split_experts_are_made_whole_for_a_universal_checkpoint_and_bad_files_are_refused(tmp_path):
    """What train/expert_checkpoint.py does around DeepSpeed's conversion, on files shaped as a
    2-rank expert-parallel run writes them (tests/test_stages.py moves real runs): each rank's
    expert fragments renamed by its expert-parallel rank (ranks 0 and 2 of 4 are rank 0), the
    shapes named once per rank, the tensor-parallel description no longer calling the experts
    replicated, and after the conversion the ranks' folders joined in rank order and marked as
    expert parameters. A file that is not what a checkpoint holds, a rank missing, a wrong
    number of experts and a file that would run code when unpickled are each refused by name."""
    from collections import OrderedDict

    from deepspeed.checkpoint.constants import EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM
    from deepspeed.utils.tensor_fragment import fragment_address

    from lmfoundry.model.moe import MoEConfig
    from lmfoundry.model.transformer import ModelConfig
    from lmfoundry.train.expert_checkpoint import (
        join_experts,
        pad_parameter_groups,
        prepare_for_conversion,
        routed_expert_names,
    )

    cfg = ModelConfig(vocab_size=32, max_seq_len=8, n_layer=2, d_model=16, n_head=2, n_kv_head=1)
    cfg = cfg.model_copy(update={"moe": MoEConfig(num_experts=4, top_k=2, first_dense_layers=1)})
    experts = routed_expert_names(cfg, pipelined=False)
    assert experts == ["blocks.1.mlp.w_gate_up", "blocks.1.mlp.w_down"]
    assert routed_expert_names(cfg, pipelined=True) == ["2.block.mlp.w_gate_up", "2.block.mlp.w_down"]
    state = tmp_path / "state"
    state.mkdir()
    for dp in range(4):
        mapping = OrderedDict([("norm.weight", fragment_address(0, 16)), (experts[0], fragment_address(16, 8))])
        torch.save(
            {"optimizer_state_dict": {"param_slice_mappings": [mapping]}},
            state / f"{'bf16_' if dp == 3 else ''}zero_pp_rank_{dp}_mp_rank_00_optim_states.pt",  # a bf16 run's name
        )
    shapes = [OrderedDict([("norm.weight", torch.Size([16])), (experts[0], torch.Size([2, 16, 64]))])]
    torch.save({"param_shapes": shapes}, state / "mp_rank_00_model_states.pt")
    torch.save({"embed.weight": torch.zeros(1)}, state / "layer_00-model_00-model_states.pt")
    prepared = prepare_for_conversion(state, tmp_path / "input", experts, ep=2, tp=1)
    assert (prepared / "layer_00-model_00-model_states.pt").is_symlink()
    for dp, rank in ((0, 0), (1, 1), (2, 0), (3, 1)):
        name = f"{'bf16_' if dp == 3 else ''}zero_pp_rank_{dp}_mp_rank_00_optim_states.pt"
        assert not (prepared / name).is_symlink()
        saved = torch.load(prepared / name, weights_only=False)
        assert list(saved["optimizer_state_dict"]["param_slice_mappings"][0]) == [
            "norm.weight",
            f"{experts[0]}@expert-rank-{rank}",
        ]
    saved = torch.load(prepared / "mp_rank_00_model_states.pt", weights_only=False)
    assert list(saved["param_shapes"][0]) == [
        "norm.weight",
        f"{experts[0]}@expert-rank-0",
        f"{experts[0]}@expert-rank-1",
    ]

    # under tensor parallelism: the experts out of the replicated patterns and the affine maps
    tp_state = tmp_path / "tp-state"
    tp_state.mkdir()
    info = {
        "tp_replicated_parameter_patterns": [r"^norm\.weight$", r"^blocks\.1\.mlp\.w_gate_up$"],
        "affine_map": {"version": 1, "params": {r"^blocks\.1\.mlp\.w_down$": {}, r"^norm\.weight$": {}}},
    }
    torch.save({"universal_checkpoint_info": info}, tp_state / "mp_rank_01_model_states.pt")
    prepare_for_conversion(tp_state, tmp_path / "tp-input", experts, ep=2, tp=2)
    saved = torch.load(tmp_path / "tp-input" / "mp_rank_01_model_states.pt", weights_only=False)[
        "universal_checkpoint_info"
    ]
    assert saved["tp_replicated_parameter_patterns"] == [r"^norm\.weight$"]
    assert list(saved["affine_map"]["params"]) == [r"^norm\.weight$"]

    # after the conversion: each rank's folder joined in rank order, the step kept, marked
    zero = tmp_path / "zero"
    rows = {rank: torch.full((2, 3), float(rank)) for rank in range(2)}
    for name in experts:
        for rank, value in rows.items():
            folder = zero / f"{name}@expert-rank-{rank}"
            folder.mkdir(parents=True)
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                torch.save({PARAM: value, "cat_dim": 0}, folder / f"{key}.pt")
            torch.save(torch.tensor(6.0), folder / "step.pt")
    (zero / experts[0]).mkdir()  # the conversion's copy of rank 0's module value, replaced
    torch.save({PARAM: rows[0]}, zero / experts[0] / "fp32.pt")
    join_experts(zero, experts, ep=2, tp=1, num_experts=4)
    for name in experts:
        assert sorted(p.name for p in (zero / name).iterdir()) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
        joined = torch.load(zero / name / "exp_avg.pt", weights_only=False)
        assert torch.equal(joined[PARAM], torch.cat([rows[0], rows[1]]))
        assert joined[EP_IS_EXPERT_PARAM] is True and joined[EP_NUM_EXPERTS] == 4
    assert not list(zero.glob("*@expert-rank-*"))
    # the same folders marked again (a tensor-parallel run's, joined by the conversion): unchanged
    join_experts(zero, experts, ep=2, tp=2, num_experts=4)
    with pytest.raises(
        ValueError, match=r"blocks.1.mlp.w_gate_up \(exp_avg\) has shape \(4, 3\); the model's 8 experts"
    ):
        join_experts(zero, experts, ep=2, tp=2, num_experts=8)
    with pytest.raises(
        ValueError, match=r"no state for blocks.1.mlp.w_gate_up@expert-rank-0: its experts are not split 2 ways"
    ):
        join_experts(zero, experts, ep=2, tp=1, num_experts=4)
    torch.save(["not", "a", "dict"], zero / experts[1] / "fp32.pt")
    with pytest.raises(ValueError, match="fp32.pt holds list, not a dict"):
        join_experts(zero, experts, ep=1, tp=1, num_experts=4)

    # the optimizer's groups padded so that a run with expert groups restores all of its groups
    groups = [{"name": "decay", "weight_decay": 0.1}, {"name": "no_decay", "weight_decay": 0.0}]
    torch.save({"param_groups": groups, "zero_stage": 2}, zero / "optimizer_state.pt")
    pad_parameter_groups(zero)
    padded = torch.load(zero / "optimizer_state.pt", weights_only=False)
    assert padded["param_groups"] == [*groups, groups[1], groups[1]] and padded["zero_stage"] == 2
    torch.save({"param_groups": []}, zero / "optimizer_state.pt")
    with pytest.raises(ValueError, match="optimizer_state.pt holds no parameter groups"):
        pad_parameter_groups(zero)

    # bad files in the checkpoint's folder, refused before the conversion runs: a name that
    # would lead out of the conversion's folder (dense checkpoints' too), or a rank short of experts
    for bad in ("../../outside", "/tmp/outside", "blocks..1", ""):
        torch.save({"param_shapes": [{bad: torch.Size([2])}]}, state / "mp_rank_00_model_states.pt")
        with pytest.raises(ValueError, match="names a parameter .*dot-separated letters"):
            prepare_for_conversion(state, tmp_path / f"input-{len(bad)}", [], ep=1, tp=1)
    torch.save({"param_shapes": shapes}, state / "mp_rank_00_model_states.pt")
    mapping = {"../outside": fragment_address(0, 4)}
    torch.save(
        {"optimizer_state_dict": {"param_slice_mappings": [mapping]}},
        state / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt",
    )
    with pytest.raises(
        ValueError, match="bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt names a parameter '../outside'"
    ):
        prepare_for_conversion(state, tmp_path / "input-5", [], ep=1, tp=1)
    (state / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt").unlink()
    uneven = tmp_path / "uneven"
    for rank, rows in ((0, 3), (1, 1)):
        (uneven / f"{experts[0]}@expert-rank-{rank}").mkdir(parents=True)
        torch.save({PARAM: torch.zeros(rows, 3)}, uneven / f"{experts[0]}@expert-rank-{rank}" / "fp32.pt")
    with pytest.raises(ValueError, match="each of its 2 expert-parallel ranks must hold 2 of the 4 experts"):
        join_experts(uneven, experts[:1], ep=2, tp=1, num_experts=4)
    torch.save({"optimizer_state_dict": {}}, state / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(ValueError, match="has no parameter slice map"):
        prepare_for_conversion(state, tmp_path / "input-2", experts, ep=2, tp=1)
    torch.save(
        {"optimizer_state_dict": {"param_slice_mappings": []}}, state / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    )
    torch.save({"param_shapes": "no"}, state / "mp_rank_00_model_states.pt")
    with pytest.raises(ValueError, match="mp_rank_00_model_states.pt: param_shapes is not a list of dicts"):
        prepare_for_conversion(state, tmp_path / "input-3", experts, ep=2, tp=1)
    ran = tmp_path / "ran"
    torch.save({"param_shapes": [RunsCode(ran)]}, state / "mp_rank_00_model_states.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        prepare_for_conversion(state, tmp_path / "input-4", experts, ep=2, tp=1)
    assert not ran.exists()


def test_a_moves_name_check_reads_the_names_of_a_file_it_links_not_its_tensors(tmp_path):
    """Every move checks each optimizer and model-state file's parameter names before DeepSpeed's
    converter reads the file; a file the converter reads as it is (a link) is mapped for the check,
    not read, so a move reads its tensors once (the bytes this process reads, from /proc/self/io)."""
    from collections import OrderedDict

    from deepspeed.utils.tensor_fragment import fragment_address

    from lmfoundry.train.expert_checkpoint import prepare_for_conversion

    def bytes_read() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

    state = tmp_path / "state"
    state.mkdir()
    moments = {"exp_avg": torch.randn(2_000_000), "exp_avg_sq": torch.randn(2_000_000)}
    for dp in range(2):
        optimizer = {
            "param_slice_mappings": [OrderedDict([("norm.weight", fragment_address(0, 16))])],
            "fp32_flat_groups": [torch.randn(2_000_000)],
            "base_optimizer_state": {"state": {0: moments}},
        }
        torch.save({"optimizer_state_dict": optimizer}, state / f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt")
    shapes = [OrderedDict([("norm.weight", torch.Size([16]))])]
    torch.save(
        {"param_shapes": shapes, "module": {"norm.weight": torch.randn(2_000_000)}},
        state / "mp_rank_00_model_states.pt",
    )
    size = sum(p.stat().st_size for p in state.iterdir())
    before = bytes_read()
    prepared = prepare_for_conversion(state, tmp_path / "input", [], ep=1, tp=1)
    read = bytes_read() - before
    assert all(p.is_symlink() for p in prepared.iterdir())
    assert size > 50 * 2**20 and read < 2**20, (size, read)
    # mapped or read, a file is loaded weights-only, and one torch cannot load is refused by name
    ran, model_states = tmp_path / "ran", state / "mp_rank_00_model_states.pt"
    torch.save({"param_shapes": [RunsCode(ran)]}, model_states)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        prepare_for_conversion(state, tmp_path / "input-2", [], ep=1, tp=1)
    assert not ran.exists()
    for damaged in (b"", b"PK\x03\x04 not a checkpoint", model_states.read_bytes()[:1000]):
        model_states.write_bytes(damaged)
        with pytest.raises(ValueError, match="the checkpoint file mp_rank_00_model_states.pt cannot be read"):
            prepare_for_conversion(state, tmp_path / f"input-{len(damaged)}", [], ep=1, tp=1)


def test_a_ranks_expert_file_holds_its_experts_only_and_bad_ones_are_refused_by_name(tmp_path):
    """Under expert parallelism each rank writes its own experts beside DeepSpeed's files, which
    hold the rest: the file holds the routed-expert tensors only, and reads back into them; a
    file written when it held the whole module still reads; a missing tensor, a wrong shape, a
    non-dict and a pickle that would run code are refused."""
    from lmfoundry.model.moe import MoEConfig
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.train.checkpointing import _load_own_experts, _own_experts

    cfg = ModelConfig(vocab_size=32, max_seq_len=8, n_layer=2, d_model=16, n_head=2, n_kv_head=1)
    cfg = cfg.model_copy(update={"moe": MoEConfig(num_experts=4, top_k=2, first_dense_layers=1)})
    written, resumed = Transformer(cfg), Transformer(cfg)
    own = _own_experts(written)
    assert sorted(own) == ["blocks.1.mlp.w_down", "blocks.1.mlp.w_gate_up"]
    path = tmp_path / "module-rank-1.pt"
    torch.save(own, path)
    _load_own_experts(resumed, path, "ckpt")
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in own.items())
    assert not torch.equal(resumed.embed.weight, written.embed.weight)  # the rest is DeepSpeed's to load
    torch.save(written.state_dict(), path)  # an older file: the whole module
    _load_own_experts(resumed, path, "ckpt")
    torch.save({"blocks.1.mlp.w_down": own["blocks.1.mlp.w_down"]}, path)
    with pytest.raises(ValueError, match=r"holds blocks.1.mlp.w_gate_up of shape None; this rank's is \(4, 16, "):
        _load_own_experts(resumed, path, "ckpt")
    torch.save({**own, "blocks.1.mlp.w_down": torch.zeros(2, 3)}, path)
    with pytest.raises(ValueError, match=r"holds blocks.1.mlp.w_down of shape \(2, 3\)"):
        _load_own_experts(resumed, path, "ckpt")
    torch.save([own], path)
    with pytest.raises(ValueError, match="module-rank-1.pt holds list, not a dict"):
        _load_own_experts(resumed, path, "ckpt")
    ran = tmp_path / "ran"
    torch.save({"blocks.1.mlp.w_down": RunsCode(ran)}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _load_own_experts(resumed, path, "ckpt")
    assert not ran.exists()


@pytest.mark.parametrize(
    "ep, world, tp, pp, experts",
    [(2, 2, 1, 1, None), (3, 6, 1, 1, 4), (4, 4, 1, 2, 4), (4, 4, 2, 1, 4), (10**12, 2, 1, 1, 4)],
    ids=["dense model", "experts not divisible", "more than a stage's ranks", "not the TP size", "huge"],
)
def test_a_written_expert_split_that_its_layout_or_model_cannot_have_is_refused(ep, world, tp, pp, experts):
    """train_state.json comes from storage: the expert-parallel size a move would read the files
    by must be one the config could have run (a huge one would have the move build that many
    names); the layouts the tests run pass."""
    from lmfoundry.model.moe import MoEConfig
    from lmfoundry.model.transformer import ModelConfig
    from lmfoundry.train.checkpointing import _check_expert_split

    cfg = ModelConfig(vocab_size=32, max_seq_len=8, n_layer=2, d_model=16, n_head=2, n_kv_head=1)
    moe = cfg.model_copy(update={"moe": MoEConfig(num_experts=4, top_k=2)})
    for layout in ((2, 2, 1, 1), (2, 4, 1, 2), (2, 2, 2, 1), (2, 4, 2, 1), (1, 3, 3, 1)):
        _check_expert_split(*layout, moe, "ckpt")
    with pytest.raises(ValueError, match="it must divide the experts and a stage's data-parallel workers"):
        _check_expert_split(ep, world, tp, pp, moe if experts else cfg, "ckpt")


def test_a_universal_load_into_other_parameter_groups_keeps_each_groups_settings_and_the_schedule():
    """DeepSpeed's universal load copies the checkpoint's group settings onto the engine's by
    position, and its scheduler state: from a run without expert groups into one with them (and
    back), each group keeps its own name, decay and MoE flag, every group trains at the rate the
    checkpoint's last step set, and the schedule goes on over all of them."""
    from types import SimpleNamespace

    from lmfoundry.train.checkpointing import OWN_GROUP_SETTINGS, _mend_universal_load, _scheduler_fitted_to_groups
    from lmfoundry.train.engine import WSDSchedule

    def engine(groups: list[dict]):
        params = [{"params": [torch.nn.Parameter(torch.zeros(2))], **g} for g in groups]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WSDSchedule(10, 2, 0.5, 0.1, "linear"))
        return SimpleNamespace(optimizer=optimizer, lr_scheduler=schedule)

    dense = [{"name": "decay", "weight_decay": 0.1}, {"name": "no_decay", "weight_decay": 0.0}]
    expert = [*dense, {"name": "ep_size_2", "weight_decay": 0.1, "moe": True}]
    for written, resumed in ((dense, expert), (expert, dense)):
        source, target = engine(written), engine(resumed)
        for _ in range(7):  # into the decay: a rate of its own
            source.optimizer.step()
            source.lr_scheduler.step()
        own = [{k: g.get(k) for k in OWN_GROUP_SETTINGS} for g in target.optimizer.param_groups]
        # what the load does: the checkpoint's groups' settings by position, its scheduler's state
        for group, loaded in zip(target.optimizer.param_groups, source.optimizer.param_groups):
            group.update({k: v for k, v in loaded.items() if k != "params"})
        with _scheduler_fitted_to_groups(target):
            target.lr_scheduler.load_state_dict(source.lr_scheduler.state_dict())
        _mend_universal_load(target, own)
        assert len(target.lr_scheduler.base_lrs) == len(resumed)
        rate = source.optimizer.param_groups[0]["lr"]
        assert rate < 1e-3
        for group, settings in zip(target.optimizer.param_groups, resumed, strict=True):
            assert group["lr"] == rate and group["name"] == settings["name"]
            assert group["weight_decay"] == settings["weight_decay"] and group.get("moe") == settings.get("moe")
        target.optimizer.step()
        target.lr_scheduler.step()
        source.optimizer.step()
        source.lr_scheduler.step()
        expected = source.optimizer.param_groups[0]["lr"]
        assert [g["lr"] for g in target.optimizer.param_groups] == [expected] * len(resumed)


def test_a_sequence_that_does_not_split_evenly_over_the_group_is_refused_by_name():
    import pytest

    from lmfoundry.train.tensor_parallel import _check_splits

    _check_splits(64, 2)
    with pytest.raises(ValueError, match="a sequence of 63 tokens does not split evenly .use a multiple of 2."):
        _check_splits(63, 2)


@pytest.mark.parametrize(
    "layout",
    ["TP 2, untied, from a checkpoint", "TP 2 x PP 2, tied, vocab parallel", "DP 2, ZeRO-3, untied, from a checkpoint"],
)
def test_a_model_parallel_model_built_on_the_meta_device_holds_the_whole_builds_parts(
    deepspeed_processes, layout, tmp_path
):
    # each rank holds bitwise what the same rank holds when the model is built whole and split:
    # at TP 2, continuing from a checkpoint's weights (vocabulary and sequence parallel, untied:
    # the embedding split before the engine, the head and the column and row layers and the
    # column layers' biases by AutoTP, the norms whole), at TP 2 x PP 2 from new initial
    # values (each stage's layers split over 2 ranks by AutoTP inside the engine, the rest given
    # at the stage's placement, the tied embedding split by vocabulary on the first and the
    # last stage as it is placed), and under ZeRO-3
    # (each parameter partitioned as it is read from the checkpoint; compared gathered whole)
    from harness.model_parallel import SEQ_LEN, small_config
    from harness.parallel_build import build_both_ways

    from lmfoundry.model.checkpoint import save_model_files
    from lmfoundry.model.transformer import Transformer

    start = None
    if "from a checkpoint" in layout:
        if layout.startswith("DP 2, ZeRO-3"):
            cfg = small_config(1, 1, 2, tied=False)
            cfg = cfg.model_copy(update={"parallelism": cfg.parallelism.model_copy(update={"zero_stage": 3})})
        else:
            cfg = small_config(2, 1, 2, sequence_parallel=True, vocab_parallel=True, tied=False)
        trained = Transformer(cfg.model)
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(torch.randn_like(p))  # not its initial values
        save_model_files(trained, tmp_path)
        start = str(tmp_path)
    else:
        cfg = small_config(2, 2, 4, vocab_parallel=True)
    built = build_both_ways(cfg, SEQ_LEN, keep_parameters=True, start=start, same_processes=True)
    for rank in built["whole"]:
        meta, whole = built["meta"][rank]["parameters"], built["whole"][rank]["parameters"]
        assert meta.keys() == whole.keys()
        for name in whole:
            assert meta[name].shape == whole[name].shape and torch.equal(meta[name], whole[name]), (rank, name)
    if "ZeRO-3" in layout:  # each rank holds half of every partitioned parameter; gathered, the checkpoint's
        for rank in (0, 1):
            report = built["meta"][rank]
            assert report["rank_parameter_bytes"] < 0.6 * report["model_bytes"]
            for name, value in trained.state_dict().items():
                assert torch.equal(report["parameters"][name], value), name
    elif start is not None:  # split, not whole
        for rank in (0, 1):
            parameters = built["meta"][rank]["parameters"]
            assert parameters["embed.weight"].shape[0] == 48 and parameters["lm_head.weight"].shape[0] == 48
        first, second = (built["meta"][rank]["parameters"]["lm_head.weight"] for rank in (0, 1))
        assert not torch.equal(first, second)
    else:  # each stage its own blocks, split: ranks 0, 1 the first stage, 2, 3 the second
        first, second = built["meta"][0]["parameters"], built["meta"][2]["parameters"]
        assert "1.block.attn.wq.weight" in first and "1.block.attn.wq.weight" not in second
        assert first["1.block.attn.wq.weight"].shape[0] == 32  # of 64 rows
        assert not torch.equal(
            first["1.block.attn.wq.weight"], built["meta"][1]["parameters"]["1.block.attn.wq.weight"]
        )


def test_a_zero3_bf16_build_on_the_meta_device_casts_the_adapters_and_places_the_buffers(deepspeed_processes, tmp_path):
    # under ZeRO-3 the engine neither casts nor moves a model that is partitioned already: the
    # build casts what it did not read from the checkpoint (an adapter, made on the CPU in fp32)
    # and moves the rotary tables to the rank's device itself
    from harness.model_parallel import small_config
    from harness.parallel_build import zero3_bf16_adapter_build

    from lmfoundry.model.checkpoint import save_model_files
    from lmfoundry.model.transformer import Transformer

    cfg = small_config(1, 1, 1)
    cfg = cfg.model_copy(update={"parallelism": cfg.parallelism.model_copy(update={"zero_stage": 3})})
    save_model_files(Transformer(cfg.model), tmp_path)
    report = zero3_bf16_adapter_build(cfg, str(tmp_path))
    assert report["partition_dtypes"] == ["torch.bfloat16"]
    assert report["buffer_devices"] == [report["engine_device"]]
    assert math.isfinite(report["loss"])


def test_the_placement_patch_is_one_at_a_time_and_leaves_deepspeeds_class_as_it_was():
    from deepspeed.runtime.engine import DeepSpeedEngine

    from lmfoundry.train.meta_init import materialized_on_placement

    own = DeepSpeedEngine._configure_distributed_model
    model = torch.nn.Linear(2, 2)
    with materialized_on_placement(model, {}):
        assert DeepSpeedEngine._configure_distributed_model is not own
        with pytest.raises(RuntimeError, match="one at a time"):
            with materialized_on_placement(model, {}):
                pass
        assert DeepSpeedEngine._configure_distributed_model is not own  # the outer patch still there
    assert DeepSpeedEngine._configure_distributed_model is own
    with pytest.raises(KeyError):
        with materialized_on_placement(model, {}):
            raise KeyError("a failed build")
    assert DeepSpeedEngine._configure_distributed_model is own


def one_step(engine, tokens: torch.Tensor, micro_batch_size: int, poison: bool = False) -> None:
    """One optimizer step of `engine` on `tokens`; `poison`: one weight's gradient is NaN."""
    hook = next(engine.module.parameters()).register_hook(lambda g: torch.full_like(g, math.nan)) if poison else None
    for rows in tokens.split(micro_batch_size):
        engine.backward(engine(rows[:, :-1], rows[:, 1:])[1])
        engine.step()
    if hook is not None:
        hook.remove()


def _gradient_norms(rank: int, port: int, cases: list[tuple[int, float]], results) -> None:
    from lmfoundry.train.pretrain import build_pretrain_engine

    start_rank(rank, 1, port)
    try:
        norms = []
        for zero, clip in cases:
            cfg = small_config(1, 1, 1, zero_stage=zero)
            cfg = cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"grad_clip": clip})})
            engine, _, ds_config = build_pretrain_engine(cfg, 1, SEQ_LEN)
            tokens = torch.randint(
                0, cfg.model.vocab_size, (8, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0)
            )
            one_step(engine, tokens, cfg.batch.micro_batch_size)
            assert engine.global_steps == 1 and ds_config["gradient_clipping"] == clip
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
            one_step(engine, tokens, cfg.batch.micro_batch_size)  # the warm-up's first learning rate is 0
            # a step with a NaN gradient in one weight: not taken, its gradients dropped
            weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            lr = engine.get_lr()
            assert lr[0] > 0
            one_step(engine, tokens, cfg.batch.micro_batch_size, poison=True)
            assert not engine.was_step_applied() and engine.skipped_steps == 1 and engine.get_lr() == lr
            assert all(torch.equal(p, weights[n]) for n, p in engine.module.named_parameters())
            one_step(engine, tokens, cfg.batch.micro_batch_size)  # and the next is taken, from the same schedule
            assert engine.was_step_applied() and math.isfinite(engine.get_global_grad_norm())
            assert not all(torch.equal(p, weights[n]) for n, p in engine.module.named_parameters())
            engine.destroy()
        results[rank] = norms
    finally:
        dist.destroy_process_group()


def _nan_on_one_rank(rank: int, port: int, results) -> None:
    from lmfoundry.train.pretrain import build_pretrain_engine

    start_rank(rank, 2, port)
    try:
        cfg = small_config(1, 1, 2, zero_stage=0)
        engine, _, _ = build_pretrain_engine(cfg, 2, SEQ_LEN)
        tokens = torch.randint(0, cfg.model.vocab_size, (8, SEQ_LEN + 1), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):  # past the warm-up's learning rate of 0
            one_step(engine, tokens, cfg.batch.micro_batch_size)
        weights = [p.detach().clone() for p in engine.module.parameters()]
        one_step(engine, tokens, cfg.batch.micro_batch_size, poison=rank == 1)
        skipped = not engine.was_step_applied()
        unchanged = all(torch.equal(p, w) for p, w in zip(engine.module.parameters(), weights))
        results[rank] = (skipped, unchanged)
        engine.destroy()
    finally:
        dist.destroy_process_group()


def test_without_zero_one_ranks_nan_gradient_skips_the_step_on_every_rank(deepspeed_processes):
    """Data parallel over 2 ranks without ZeRO, rank 1's gradients NaN: the norm is reduced over
    the ranks, so both skip the step and keep their weights (one rank stepping alone would part
    the replicas)."""
    assert spawn_ranks(_nan_on_one_rank, (), 2) == {0: (True, True), 1: (True, True)}


def test_a_run_without_zero_keeps_the_gradient_norm_with_clipping_on_and_off(deepspeed_processes):
    """DeepSpeed keeps no gradient norm without ZeRO in fp32 (train/engine.py
    keep_fp32_gradient_norm): the engine's is ZeRO-1's, clipping or not. And, as ZeRO-1 does,
    it skips a step whose gradients are not finite: the weights and the schedule as they were."""
    cases = [(1, 1.0), (0, 1.0), (0, 0.0)]
    zero1, clipped, unclipped = spawn_ranks(_gradient_norms, (cases,), 1)[0]
    assert zero1 > 0
    assert clipped == pytest.approx(zero1, rel=1e-5) and unclipped == pytest.approx(zero1, rel=1e-5)
