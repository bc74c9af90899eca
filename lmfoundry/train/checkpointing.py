"""Checkpoint save and resume. A save is collective: every rank snapshots its share of the
training state in memory (DeepSpeed's files, its RNG states, its own experts) and rank 0 the
servable model files; the files are written and persisted in the background
(platform/checkpoint.py). A resume loads the newest valid checkpoint on every rank, converting
it through a DeepSpeed universal checkpoint when the layout (workers, tensor-parallel size,
pipeline stages) changed."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE
from lmfoundry.model.checkpoint import (
    TIED_HEAD,
    TOKENIZER,
    WEIGHTS,
    save_adapter_files,
    save_model_config,
    save_model_files,
)
from lmfoundry.model.lora import AdapterRef, LoRALinear, adapter_state
from lmfoundry.model.moe import MoE
from lmfoundry.model.tensor_files import DTYPE_NAMES, write_safetensors
from lmfoundry.model.tokenizer import SPECIAL_TOKENS_FILE
from lmfoundry.model.transformer import build_on_meta, persistent_buffers
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.log import get_logger
from lmfoundry.train import tensor_parallel
from lmfoundry.train.config import MAX_VIRTUAL_STAGES
from lmfoundry.train.expert_checkpoint import (
    ROUTED_EXPERT_TENSORS,
    join_experts,
    pad_parameter_groups,
    prepare_for_conversion,
    routed_expert_names,
)
from lmfoundry.train.expert_parallel import full_state, gathered_experts
from lmfoundry.train.pipeline_parallel import pipeline_parameter_names
from lmfoundry.train.pipeline_parallel import write_servable_weights as write_pipeline_weights
from lmfoundry.train.tensor_parallel import splits_embedding_vocabulary, splits_vocabulary, tensor_parallel_size

logger = get_logger(__name__)


def stage_root(stage_dir: str | None) -> Path:
    """Where checkpoints are staged before the upload: `stage_dir`, else shared memory."""
    if stage_dir:
        return Path(stage_dir)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _expert_parallel_size(engine) -> int:
    """How many ways the engine's MoE layers split their experts (1: not split, or no MoE)."""
    return max((layer.ep_size for layer in engine.module.moe_layers()), default=1)


def _expert_parallel(engine) -> bool:
    return _expert_parallel_size(engine) > 1


def _pipelined(engine) -> bool:
    return getattr(engine, "is_pipe_parallel", False)  # DeepSpeed's pipeline engine, 2 stages or more


def _gathered(engine, names: set[str] | None = None):
    """A context in which the parameters (those `names` names, else all) are whole: under ZeRO-3
    each rank holds only a partition of each."""
    if engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    import deepspeed

    params = [p for n, p in engine.module.named_parameters() if names is None or n in names]
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _pieces(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model as the pieces a streamed save gathers one at a time, with the prefix of their
    names in the model's state: each top-level module, and each member of a module list (the
    blocks)."""
    pieces = []
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            pieces += [(f"{name}.{i}.", member) for i, member in enumerate(child)]
        else:
            pieces.append((f"{name}.", child))
    return pieces


def _zero3_gathered(piece: torch.nn.Module):
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(piece.parameters()), modifier_rank=None)


def stream_servable_weights(
    model: torch.nn.Module, path: Path | None, gathered: Callable[[torch.nn.Module], Any] = _zero3_gathered
) -> None:
    """Collective, when the weights are split over ranks (ZeRO-3 partitions, or tensor-parallel
    shards with `gathered=tensor_parallel.gathered`): the servable weights gathered piece by
    piece (the embedding, each block, the final norm, the output head) and written to `path`
    (rank 0's; None on the other ranks) while each piece is whole. Besides its own share, a rank
    holds one gathered piece at a time, whatever the size of the model (its memory rises by about
    two of the largest piece: the piece and the gather's buffer); a full gather would hold the
    whole model on every rank and a second copy on rank 0 for the write. If rank 0's write fails,
    it still takes part in the gathers left, so the other ranks are not left waiting in one, and
    then raises."""

    def kept(piece_state: dict) -> dict:  # a tied output head is stored once, as the embedding
        return {k: v for k, v in piece_state.items() if not (model.cfg.tie_embeddings and k == TIED_HEAD)}

    pieces = [
        (prefix, piece, kept({prefix + k: v for k, v in piece.state_dict(keep_vars=True).items()}))
        for prefix, piece in _pieces(model)
    ]
    declared = [name for _, _, state in pieces for name in state]
    if set(declared) != set(kept(model.state_dict(keep_vars=True))):
        raise RuntimeError("the model's state is not the union of its pieces: it holds tensors of its own")
    # each rank's tensors have its share's shape: the whole shapes are those of the model built
    # anew from its config, on the meta device (no memory)
    whole = build_on_meta(model.cfg).state_dict()
    specs = [(n, v.dtype, tuple(whole[n].shape)) for _, _, state in pieces for n, v in state.items()]
    unwritable = [(n, d) for n, d, _ in specs if d not in DTYPE_NAMES]
    if unwritable:  # on every rank, before any gather
        raise ValueError(f"tensors of dtypes safetensors cannot hold: {unwritable[:5]}")

    def gathered_tensors():  # each piece whole only while its tensors are being written
        for prefix, piece, state in pieces:
            if not state:
                continue  # the tied head: nothing of its own to gather
            with gathered(piece):
                values = piece.state_dict()
                mlp = getattr(piece, "mlp", None)
                if getattr(mlp, "ep_group", None) is not None:  # experts split over the group too
                    values.update({f"mlp.{name}": whole for name, whole in gathered_experts(mlp).items()})
                yield from (value for name, value in values.items() if prefix + name in state)

    tensors = gathered_tensors()
    try:
        if path is not None:
            write_safetensors(path, specs, tensors)
    finally:
        for _ in tensors:  # the gathers left: every rank lends its partitions to each
            pass


def stage_checkpoint(
    engine,
    rank: int,
    step: int,
    state: dict,
    tokenizer_json: str,
    chat_template: str,
    root: Path,
    special_tokens: str | None = None,
    adapter: AdapterRef | None = None,
) -> tuple[Path, Callable[[], None]]:
    """Collective: every rank snapshots its share of the full training state in memory
    (DeepSpeed's files: module, this rank's optimizer partition, scheduler; its RNG states) and
    rank 0 the servable model files, tokenizer, chat template and training state. Returns the local directory
    the files go to and the function that writes them there (for the background thread). With an
    `adapter` (LoRA) the base weights, frozen, are neither in DeepSpeed's files nor in the servable
    ones: those hold the adapter and the reference to its base."""
    root.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f"lmfoundry-{checkpoint.step_name(step)}-rank{rank}-", dir=root))
    pool = engine.checkpoint_engine.pool
    # DeepSpeed's MoE save would write a pipeline stage's whole module into its data-parallel
    # rank 0's one file, and no layer files: a pipeline saves as a dense one, its ranks' experts
    # in files of their own (below)
    with _without_deepspeed_moe(engine) if _pipelined(engine) else contextlib.nullcontext():
        engine.save_checkpoint(
            str(staged / "deepspeed"), tag="state", save_latest=False, exclude_frozen_parameters=adapter is not None
        )
    rng = checkpoint.capture_rng_state()
    # DeepSpeed keeps one module file, rank 0's: each rank's own experts go in a file of its own
    own_experts = pool.snapshot(_own_experts(engine.module), ("own",)) if _expert_parallel(engine) else None
    weights = None
    split = tensor_parallel_size(engine) > 1
    pipelined = _pipelined(engine)
    streamed = (engine.zero_optimization_stage() == 3 or split or pipelined) and adapter is None
    if streamed:  # written now, piece by piece: the weights are never whole in one process
        # the config refuses ZeRO-3 with MoE: experts are split in a pipeline stage or over a
        # tensor-parallel group, and gathered with the layer that holds them
        assert not _expert_parallel(engine) or pipelined or split
        path = staged / WEIGHTS if rank == 0 else None
        if pipelined:
            write_pipeline_weights(engine, path)
        elif split:
            if rank < tensor_parallel_size(engine):  # rank 0's group (consecutive ranks) alone gathers
                stream_servable_weights(engine.module, path, tensor_parallel.gathered)
        else:
            stream_servable_weights(engine.module, path)
    else:
        # (under ZeRO-3 with an adapter, only the adapter's partitions are lent, not the base's)
        lent = set(adapter_state(dict(engine.module.named_parameters()))) if adapter is not None else None
        with _gathered(engine, lent):
            weights = full_state(engine.module)  # collective: gathers sharded experts
            if adapter is not None:
                weights = adapter_state(weights)
            weights = pool.snapshot(weights, ("servable",)) if rank == 0 else None
    write_deepspeed = engine.checkpoint_engine.take_writer()  # marks the pool busy until written
    module = engine.module

    def write() -> None:
        write_deepspeed()
        # JSON and safetensors, not a pickle: resuming never unpickles what storage holds
        checkpoint.write_rng_state(staged / "deepspeed", rng, suffix=f"-rank-{rank}")
        if own_experts is not None:
            torch.save(own_experts, staged / "deepspeed" / f"module-rank-{rank}.pt")
        if rank == 0:
            if streamed:
                save_model_config(module, staged)
            elif adapter is None:
                save_model_files(module, staged, weights)
            else:
                save_adapter_files(module, staged, weights, adapter)
            (staged / TOKENIZER).write_text(tokenizer_json)
            (staged / CHAT_TEMPLATE_FILE).write_text(chat_template)  # serving and export read it
            if special_tokens is not None:
                (staged / SPECIAL_TOKENS_FILE).write_text(special_tokens)
            storage.write_json_atomic(str(staged / "train_state.json"), state)

    return staged, write


def resume(engine, run_dir: str, rank: int, world: int, before_step: int | None = None) -> dict | None:
    """Load the newest valid checkpoint of the run (older than `before_step`, when given) into
    the engine; its training state, or None when there is none. Rank 0 chooses (and clears
    saves cut short), so every rank loads the same."""
    import torch.distributed as dist

    chosen = [None]
    if rank == 0:
        for uri in checkpoint.remove_uncommitted(run_dir):
            logger.warning("removed checkpoint %s: its save was cut short (no manifest)", uri)
        chosen = [checkpoint.latest_valid(run_dir, before_step)]
    dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return None
    local = Path(checkpoint.local_copy(chosen[0]))
    try:
        return _load(engine, local, chosen[0], rank, world)
    finally:
        if str(local) != checkpoint.resolve(chosen[0]):  # a temporary copy of a remote checkpoint
            shutil.rmtree(local, ignore_errors=True)


def written_vocabulary_split(state: dict, tied: bool) -> tuple[bool, bool]:
    """Whether the checkpoint's files hold the head's, and the embedding's, rows split by
    vocabulary. Written before lmfoundry split heads: neither. Written before it split untied
    embeddings: the embedding only when tied (it is the head's weight). The file comes from
    storage: anything but true or false (a string "false" would read as true) is refused."""
    head = state.get("vocab_parallel", False)
    embedding = state.get("vocab_parallel_embedding", head is True and tied)
    for key, value in (("vocab_parallel", head), ("vocab_parallel_embedding", embedding)):
        if not isinstance(value, bool):
            raise ValueError(f"train_state.json: {key} is {value!r}; allowed: true or false")
    return head, embedding


def _load(engine, local: Path, uri: str, rank: int, world: int) -> dict:
    """Load the checkpoint in `local` (the copy of `uri`) into the engine; its training state."""
    import torch.distributed as dist

    state = checkpoint.load_json_state(local / "train_state.json")
    _check_position(state, uri)
    written_by, written_tp, written_pp, written_virtual = _written_layout(state, uri)
    tp, pp = tensor_parallel_size(engine), engine.num_stages if _pipelined(engine) else 1
    virtual = getattr(engine.module, "virtual_stages", 1) if pp > 1 else 1
    # a vocabulary-parallel head's files hold its rows' shard, a whole head's the whole table:
    # switching it at the same layout goes through the universal checkpoint too
    tied = getattr(getattr(engine.module, "cfg", None), "tie_embeddings", False)
    # a stage's optimizer partition holds its chunks' parameters: other virtual stages, other files
    written_ep = _written_expert_parallel(state, uri)
    _check_expert_split(written_ep, written_by, written_tp, written_pp, getattr(engine.module, "cfg", None), uri)
    ep = _expert_parallel_size(engine)
    written = (
        written_by,
        written_tp,
        written_pp,
        written_virtual,
        written_ep,
        *written_vocabulary_split(state, tied),
    )
    relayout = written != (world, tp, pp, virtual, ep, splits_vocabulary(engine), splits_embedding_vocabulary(engine))
    load_dir = local / "deepspeed"
    if relayout:
        load_dir = universal_copy(
            local,
            uri,
            from_pipeline=written_pp > 1,
            to_pipeline=pp > 1,
            model_cfg=engine.module.cfg,
            written_split=(written_ep, written_tp),
        )
        engine._config.load_universal_checkpoint = True  # read per load: this load only
        own_settings = [{k: g.get(k) for k in OWN_GROUP_SETTINGS} for g in engine.optimizer.param_groups]
    # DeepSpeed's MoE loader wants per-expert files that it writes only for its own MoE layers;
    # lmfoundry's experts come back from each rank's module file instead
    try:
        with (
            _without_deepspeed_moe(engine),
            _scheduler_fitted_to_groups(engine) if relayout else contextlib.nullcontext(),
        ):
            # a LoRA run's files leave out the frozen base, which every worker loaded from the base
            # checkpoint; any other run's (`freeze` included) hold every parameter, and load strictly
            adapted = any(isinstance(m, LoRALinear) for m in engine.module.modules())
            engine.load_checkpoint(str(load_dir), tag="state", load_module_strict=not adapted)
    finally:
        engine._config.load_universal_checkpoint = False
    if relayout:
        _mend_universal_load(engine, own_settings)
        _load_universal_buffers(engine, load_dir / "state" / "zero", uri)
        dist.barrier()  # every rank of the node has loaded it: the converted copy can go
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(load_dir, ignore_errors=True)
    if _expert_parallel(engine) and not relayout:  # a move's universal load gave each rank its experts
        _load_own_experts(engine.module, local / "deepspeed" / f"module-rank-{rank}.pt", uri)
    checkpoint.load_rng_state(local / "deepspeed", suffix=f"-rank-{rank % written_by}")
    if relayout:
        # the position counts global micro-batches of micro_batch_size x data-parallel size rows;
        # a checkpoint sits on a step boundary, so the rows trained on divide evenly at the new size
        written_dp, dp = written_by // (written_tp * written_pp), world // (tp * pp)
        state = {**state, "batches_in_epoch": state["batches_in_epoch"] * written_dp // dp}
    if rank == 0:
        logger.info(
            "resumed from %s: step %d, epoch %d, %d micro-batches into the epoch%s",
            uri,
            state["step"],
            state["epoch"],
            state["batches_in_epoch"],
            f" (written by {written_by} workers at tensor parallel {written_tp} and {written_pp} pipeline stages "
            f"x {written_virtual} virtual, now {world} at {tp} and {pp} x {virtual})"
            if relayout
            else "",
        )
    return state


def _own_experts(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The routed-expert tensors this rank holds (its share of each MoE layer's experts), by
    their names in `module` (a model or a pipeline stage): all a rank's file needs, as
    DeepSpeed's files hold the rest."""
    return {
        f"{name}.{tensor}": getattr(layer, tensor).detach()
        for name, layer in module.named_modules()
        if isinstance(layer, MoE)
        for tensor in ROUTED_EXPERT_TENSORS
    }


def _load_own_experts(module: torch.nn.Module, path: Path, uri: str) -> None:
    """This rank's experts from its file (weights-only), each checked against the tensor it
    fills. Files written before they held only the experts hold the whole module: the rest of
    it is what DeepSpeed's files restored, and is left as loaded."""
    saved = checkpoint.torch_load_weights(path)
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint {uri}: {path.name} holds {type(saved).__name__}, not a dict of tensors")
    for name, tensor in _own_experts(module).items():
        value = saved.get(name)
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            found = tuple(value.shape) if isinstance(value, torch.Tensor) else None
            raise ValueError(
                f"checkpoint {uri}: {path.name} holds {name} of shape {found}; this rank's is {tuple(tensor.shape)}"
            )
        with torch.no_grad():
            tensor.copy_(value)


@contextlib.contextmanager
def _without_deepspeed_moe(engine):
    """DeepSpeed's checkpoints with its MoE handling off: the engine saves and loads as for a
    dense model (lmfoundry keeps each rank's experts in a file of its own)."""
    has_moe_layers, engine.has_moe_layers = engine.has_moe_layers, False
    try:
        yield
    finally:
        engine.has_moe_layers = has_moe_layers


def _written_expert_parallel(state: dict, uri: str) -> int:
    """The expert-parallel size of the run that wrote the checkpoint (its recorded config's; 1
    where none is recorded), checked before it is compared."""
    config = state.get("config")
    parallelism = config.get("parallelism") if isinstance(config, dict) else None
    ep = parallelism.get("expert_parallel_size", 1) if isinstance(parallelism, dict) else 1
    if type(ep) is not int or ep < 1:
        raise ValueError(
            f"checkpoint {uri}: train_state.json names expert_parallel_size={ep!r}; it must be a positive integer"
        )
    return ep


def _check_expert_split(ep: int, world: int, tp: int, pp: int, model_cfg, uri: str) -> None:
    """The written expert-parallel size, checked against the layout and the model that wrote the
    checkpoint as the config checks a run's, before a move reads the files by it."""
    if ep == 1:
        return
    experts = model_cfg.moe.num_experts if getattr(model_cfg, "moe", None) else None
    stage_ranks = world // (tp * pp)  # a stage's data-parallel ranks
    if experts is None or experts % ep or (ep != tp if tp > 1 else stage_ranks % ep):
        raise ValueError(
            f"checkpoint {uri}: train_state.json names expert_parallel_size={ep} for {world} workers at tensor "
            f"parallel {tp} and {pp} pipeline stages, with {experts} experts; it must divide the experts and "
            "a stage's data-parallel workers, or equal the tensor-parallel size"
        )


# more workers than any run has: a layout from storage past it is not one a run wrote
MAX_WORLD_SIZE = 1 << 20


def _check_position(state: dict, uri: str) -> None:
    """The step, epoch and micro-batches into the epoch the checkpoint was written at, checked
    before any arithmetic is done with them (the file comes from storage)."""
    for key in ("step", "epoch", "batches_in_epoch"):
        value = state.get(key)
        if type(value) is not int or value < 0:
            raise ValueError(
                f"checkpoint {uri}: train_state.json names {key}={value!r}; it must be a non-negative integer"
            )


def _written_layout(state: dict, uri: str) -> tuple[int, int, int, int]:
    """The workers, tensor-parallel size, pipeline stages and virtual stages that wrote the
    checkpoint (older checkpoints name only the workers), checked before any arithmetic is done
    with them."""
    layout = (
        state.get("world_size"),
        state.get("tensor_parallel_size", 1),
        state.get("pipeline_parallel_size", 1),
        state.get("virtual_stages", 1),
    )
    world, tp, pp, virtual = layout
    if (
        not all(type(n) is int and 1 <= n <= MAX_WORLD_SIZE for n in layout)
        or world % (tp * pp)
        or (pp == 1 and virtual != 1)
        or virtual > MAX_VIRTUAL_STAGES
    ):
        raise ValueError(
            f"checkpoint {uri}: train_state.json names world_size={world!r}, tensor_parallel_size={tp!r}, "
            f"pipeline_parallel_size={pp!r}, virtual_stages={virtual!r}; each must be a positive integer "
            f"(at most {MAX_WORLD_SIZE}), "
            "tensor x pipeline dividing world_size, and virtual stages 1 without a pipeline, at most "
            f"{MAX_VIRTUAL_STAGES} with one"
        )
    return layout


# a parameter group's settings of its own, which a universal load would overwrite by position
OWN_GROUP_SETTINGS = ("weight_decay", "name", "moe")


def _mend_universal_load(engine, own_settings: list[dict]) -> None:
    """Undo the slips of DeepSpeed's universal load (0.19). The checkpoint's parameter groups'
    settings are copied onto the engine's by position, though the groups may differ (an MoE
    run's expert groups exist only with expert parallelism): each group gets its own weight
    decay, name and MoE flag back, and every group the rate the checkpoint's first group trained
    its last step with (lmfoundry's groups share one schedule), where a group the checkpoint
    lacked would keep the rate it was built with. Under ZeRO-3
    (stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3) every group is given the first
    group's settings, and every group's optimizer state one shared `step` tensor, which AdamW
    then advances once per group per step (the wrong bias correction from the next step on):
    each group gets its own step counter back."""
    groups = engine.optimizer.param_groups
    for group, own in zip(groups, own_settings):
        for key, value in own.items():
            if value is None:
                group.pop(key, None)
            else:
                group[key] = value
    for group in groups[1:]:
        group["lr"] = groups[0]["lr"]
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


# a torch scheduler's state entries that hold one value per parameter group
SCHEDULER_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas")


@contextlib.contextmanager
def _scheduler_fitted_to_groups(engine):
    """A context in which the engine's torch scheduler loads a state written for another number
    of parameter groups (a layout with or without expert groups): each per-group entry becomes
    the first group's, once per group of this engine, as lmfoundry's groups share one schedule.
    Torch's own load would fail, or leave the groups it lacked unscheduled."""
    scheduler = engine.lr_scheduler
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        yield
        return
    load, groups = scheduler.load_state_dict, len(scheduler.optimizer.param_groups)

    def fitted(state: dict) -> None:
        for key in SCHEDULER_PER_GROUP:
            if isinstance(state.get(key), list) and state[key] and len(state[key]) != groups:
                state = {**state, key: [state[key][0]] * groups}
        load(state)

    scheduler.load_state_dict = fitted
    try:
        yield
    finally:
        del scheduler.load_state_dict


def _load_universal_buffers(engine, zero_dir: Path, uri: str) -> None:
    """DeepSpeed's universal load gives the parameters their values through the optimizer, and
    leaves the module's persistent buffers (an MoE layer's aux-free routing bias) as they were
    built, though its conversion writes them beside the parameters: each is read from there."""
    from deepspeed.checkpoint.constants import PARAM

    for name, buffer in persistent_buffers(engine.module).items():
        path = zero_dir / name / "fp32.pt"
        if not path.is_file():
            raise ValueError(f"checkpoint {uri}: its universal copy holds no value for the buffer {name}")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        value = saved.get(PARAM) if isinstance(saved, dict) else None
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"checkpoint {uri}: its universal copy's {name} holds no tensor")
        if value.numel() != buffer.numel():
            raise ValueError(
                f"checkpoint {uri}: the buffer {name} holds {value.numel()} values; the model's has {buffer.numel()}"
            )
        buffer.copy_(value.reshape(buffer.shape))


def _extract_pipeline_buffers(state_dir: Path, zero_dir: Path, model_cfg) -> None:
    """DeepSpeed's conversion writes the persistent buffers it finds in a run's model-state file;
    a pipeline keeps its layers' in their own files, which the conversion does not read. Each is
    written here as the conversion writes a parameter (`<name in the pipeline>/fp32.pt`)."""
    from deepspeed.checkpoint.constants import PARAM

    names = pipeline_parameter_names(model_cfg)
    for model_name in persistent_buffers(build_on_meta(model_cfg)):
        name = names[model_name]
        layer, key = name.split(".", 1)
        # the first tensor-parallel rank's file: a buffer is whole on every rank
        path = state_dir / f"layer_{int(layer):02d}-model_00-model_states.pt"
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True) if path.is_file() else None
        value = state.get(key) if isinstance(state, dict) else None
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"the checkpoint's layer file {path.name} holds no tensor {key}; the model has it")
        (zero_dir / name).mkdir(exist_ok=True)
        torch.save({PARAM: value.float()}, zero_dir / name / "fp32.pt")


def _rename_parameters(zero_dir: Path, pipeline_names: dict[str, str], to_pipeline: bool) -> None:
    """A universal checkpoint's parameter folders renamed between the model's names and the
    pipeline module's (`pipeline_names`: model name -> pipeline name). A tied head, which
    DeepSpeed also writes under the head's own name, is the embedding's folder in the pipeline."""
    renames = pipeline_names if to_pipeline else {v: k for k, v in pipeline_names.items()}
    if to_pipeline and TIED_HEAD not in pipeline_names and (zero_dir / TIED_HEAD).is_dir():
        shutil.rmtree(zero_dir / TIED_HEAD)
    folders = {p.name for p in zero_dir.iterdir() if p.is_dir()}
    if folders != set(renames):
        raise ValueError(
            f"the checkpoint's parameters are not the model's: {sorted(folders ^ set(renames))[:5]} differ"
        )
    for old, new in renames.items():
        (zero_dir / old).rename(zero_dir / f"{new}.renamed")  # two passes: a new name may be an old one
    for new in renames.values():
        (zero_dir / f"{new}.renamed").rename(zero_dir / new)


# DeepSpeed's converter, run with its checkpoint classes allowed, every load weights-only, and
# every folder it makes and file it saves confined to its output folder: it makes a folder of each
# parameter name it reads, and lmfoundry's check of the names (expert_checkpoint.py) is the first
# defence against a crafted one, this the second
WEIGHTS_ONLY_UNIVERSAL_CONVERSION = """
import os, runpy, sys, torch
from lmfoundry.train.snapshot import deepspeed_checkpoint_classes
torch.serialization.add_safe_globals(deepspeed_checkpoint_classes())
output = os.path.realpath(sys.argv[sys.argv.index("--output_folder") + 1])

def confined(path):
    real = os.path.realpath(path)
    if real != output and not real.startswith(output + os.sep):
        raise PermissionError(f"the conversion writes only under its output folder, not to {path!r}")
    return path

makedirs, save = os.makedirs, torch.save
os.makedirs = lambda name, *args, **kwargs: makedirs(confined(name), *args, **kwargs)
torch.save = lambda obj, f, *args, **kwargs: save(obj, confined(f) if isinstance(f, (str, os.PathLike)) else f, *args, **kwargs)
sys.argv[0] = "ds_to_universal"
runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__")
"""


def _convert(
    state_dir: Path,
    scratch: Path,
    uri: str,
    from_pipeline: bool,
    to_pipeline: bool,
    model_cfg,
    written_split: tuple[int, int],
) -> None:
    """DeepSpeed's conversion of the checkpoint's `state_dir` into `scratch / "state"`, with
    lmfoundry's steps before and after it (universal_copy)."""
    import subprocess
    import sys

    experts = routed_expert_names(model_cfg, from_pipeline) if getattr(model_cfg, "moe", None) else []
    try:
        source = prepare_for_conversion(state_dir, scratch / "input", experts, *written_split)
    except Exception as e:  # a crafted or damaged file: named, with the checkpoint it is in
        raise ValueError(f"checkpoint {uri}: {e}") from e
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            WEIGHTS_ONLY_UNIVERSAL_CONVERSION,
            "--input_folder",
            str(source),
            "--output_folder",
            str(scratch / "state"),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            "--inject_missing_state",
        ],
        capture_output=True,
        text=True,
        # torch then loads weights-only even where DeepSpeed's converter asks for pickles
        env={**os.environ, "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"converting {uri} to a universal checkpoint failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    shutil.rmtree(scratch / "input")
    if experts:
        try:
            join_experts(scratch / "state" / "zero", experts, *written_split, model_cfg.moe.num_experts)
            pad_parameter_groups(scratch / "state" / "zero")
        except Exception as e:
            raise ValueError(f"checkpoint {uri}: {e}") from e
    if from_pipeline:
        _extract_pipeline_buffers(state_dir, scratch / "state" / "zero", model_cfg)
    if from_pipeline != to_pipeline:
        _rename_parameters(scratch / "state" / "zero", pipeline_parameter_names(model_cfg), to_pipeline)


def universal_copy(
    local: Path,
    uri: str,
    from_pipeline: bool = False,
    to_pipeline: bool = False,
    model_cfg=None,
    written_split: tuple[int, int] = (1, 1),
) -> Path:
    """The checkpoint's ZeRO state as a DeepSpeed universal checkpoint (whole parameters and
    optimizer moments, no partitioning, one folder per parameter), which loads at any world size.
    A pipelined run names its parameters by pipeline layer: the folders are renamed from the
    layout that wrote them to the one that loads them (`from_pipeline`, `to_pipeline`; the
    model's config gives the names). An MoE model's routed experts are made whole from the ways
    the run that wrote them split them (`written_split`: its expert- and tensor-parallel sizes;
    train/expert_checkpoint.py). The first rank of each node converts it into a node-local
    folder named by the checkpoint's manifest (its checksums) and the naming, so another
    checkpoint at the same path never reuses it; the node's other ranks wait for it."""
    import hashlib

    import torch.distributed as dist

    identity = hashlib.sha256(uri.encode() + (local / checkpoint.CHECKPOINT_MANIFEST).read_bytes()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"lmfoundry-universal-{identity}-{int(from_pipeline)}{int(to_pipeline)}"
    deepspeed_dir = local / "deepspeed"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not (out / "latest_universal").exists():
        shutil.rmtree(out, ignore_errors=True)  # a conversion cut short
        scratch = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp-"))
        try:
            _convert(deepspeed_dir / "state", scratch, uri, from_pipeline, to_pipeline, model_cfg, written_split)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)  # a retry converts afresh, under another name
            raise
        (scratch / "latest_universal").write_text("state")
        try:
            os.replace(scratch, out)
        except OSError:  # another node on this machine converted it first (a test's nodes share /tmp)
            if not (out / "latest_universal").exists():
                raise
            shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    return out
