"""An MoE checkpoint's routed experts through a universal (layout-free) checkpoint, so that a
run whose experts are split resumes at another layout, and a run of another layout resumes
with its experts split.

DeepSpeed's conversion (`ds_to_universal`) joins each parameter's ZeRO fragments by name over
the data-parallel ranks, and its tensor-parallel slices as the model describes them. Split
experts fit neither as they are:
- under expert parallelism every rank of an expert-parallel group holds tensors of the same
  names and shapes that hold other experts (rank e holds experts [e*E/ep, (e+1)*E/ep)): the
  conversion would join them as fragments of one tensor;
- under tensor parallelism the experts are split over the tensor-parallel group (lmfoundry's
  expert-parallel group there), and AutoTP, which does not split them itself, describes them
  as replicated: the conversion would keep one rank's and drop the others'.

So before the conversion a copy of the checkpoint's file list is prepared (unchanged files
linked): under expert parallelism each rank's expert tensors are renamed by its expert-parallel
rank, which makes them separate parameters whose fragments join within their expert-data-
parallel group; under tensor parallelism the experts' entries are taken out of the replicated
description, so their slices are joined along the expert dimension in rank order. After it,
each routed-expert tensor is written whole (every expert, in expert order) and marked as
DeepSpeed's universal load knows expert parameters (`is_expert_param`, `ep_num_experts`): a run
with split experts takes its expert-parallel rank's rows of it, any other the whole."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from lmfoundry.model.moe import MoE
from lmfoundry.model.transformer import build_on_meta
from lmfoundry.train.pipeline_parallel import pipeline_parameter_names

RANK_TAG = "@expert-rank-"  # never in a parameter's name: torch names hold no '@'
ROUTED_EXPERT_TENSORS = ("w_gate_up", "w_down")
# DeepSpeed names a bf16 (fp16) run's ZeRO files with the prefix bf16_ (fp16_)
_OPTIMIZER_FILE = re.compile(r"(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_\d+(?:_\d+)?_optim_states\.pt")
# (ZeRO-3 writes one per data-parallel rank, zero_pp_rank_<dp>_mp_rank_<tp>_model_states.pt)
_MODEL_STATE_FILE = re.compile(r"(?:zero_pp_rank_\d+_)?mp_rank_\d+(?:_\d+)?_model_states\.pt")
# a parameter's name as torch writes it; the conversion makes a folder of each name it reads
_PARAMETER_NAME = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")


def routed_expert_names(model_cfg, pipelined: bool) -> list[str]:
    """The names of the model's routed-expert tensors (each with the experts on dim 0), as the
    model names them or, `pipelined`, as its pipeline module does."""
    model = build_on_meta(model_cfg)
    names = [
        f"blocks.{i}.mlp.{tensor}"
        for i, block in enumerate(model.blocks)
        if isinstance(block.mlp, MoE)
        for tensor in ROUTED_EXPERT_TENSORS
    ]
    if pipelined:
        in_pipeline = pipeline_parameter_names(model_cfg)
        names = [in_pipeline[name] for name in names]
    return names


def _load(path: Path, mmap: bool = False) -> dict:
    from lmfoundry.train.snapshot import load_deepspeed_file

    state = load_deepspeed_file(path, "cpu", mmap)
    if not isinstance(state, dict):
        raise ValueError(f"the checkpoint file {path.name} holds {type(state).__name__}, not a dict")
    return state


def prepare_for_conversion(state_dir: Path, out: Path, expert_names: list[str], ep: int, tp: int) -> Path:
    """`out`: the files of the checkpoint's DeepSpeed folder `state_dir` as the conversion is
    to read them (written by a run with `ep` expert-parallel and `tp` tensor-parallel ranks;
    `expert_names`: the model's routed-expert tensors, none for a dense model); the files that
    need no change are links to the checkpoint's. Every parameter name the conversion will make a
    folder of is checked first: a crafted one could lead out of the conversion's folder."""
    out.mkdir(parents=True)
    split = bool(expert_names) and (tp > 1 or ep > 1)
    for path in sorted(state_dir.iterdir()):
        optimizer_file, model_state_file = _OPTIMIZER_FILE.fullmatch(path.name), _MODEL_STATE_FILE.fullmatch(path.name)
        rewritten = split and bool(model_state_file or (tp == 1 and optimizer_file))
        # a file the conversion reads as it is (a link) is mapped, not read: only its names are
        # checked here, and DeepSpeed's converter is the one to read its tensors
        state = _load(path, mmap=not rewritten) if optimizer_file or model_state_file else None
        if state is not None:
            _check_names(state, path.name)
        if split and tp == 1 and optimizer_file:
            # the expert-parallel groups are ep consecutive data-parallel ranks (of a stage)
            torch.save(_renamed_fragments(state, expert_names, int(optimizer_file[1]) % ep), out / path.name)
        elif split and tp == 1 and model_state_file:
            torch.save(_shapes_by_rank(state, expert_names, ep, path.name), out / path.name)
        elif split and model_state_file:
            torch.save(_experts_not_replicated(state, expert_names), out / path.name)
        else:
            (out / path.name).symlink_to(path.resolve())
    return out


def _check_names(state: dict, file_name: str) -> None:
    """Refuses a file whose parameter names (its ZeRO slice map's, its shapes', its module's)
    are not torch's dotted names."""
    optimizer = state.get("optimizer_state_dict")
    names = []
    if isinstance(optimizer, dict) and isinstance(optimizer.get("param_slice_mappings"), list):
        names += [n for group in optimizer["param_slice_mappings"] if isinstance(group, dict) for n in group]
    if isinstance(state.get("param_shapes"), list):
        names += [n for group in state["param_shapes"] if isinstance(group, dict) for n in group]
    if isinstance(state.get("module"), dict):
        names += list(state["module"])
    for name in names:
        if not isinstance(name, str) or not _PARAMETER_NAME.fullmatch(name):
            raise ValueError(
                f"the checkpoint file {file_name} names a parameter {name!r}; a parameter's name is "
                "dot-separated letters, digits and underscores"
            )


def _renamed_fragments(state: dict, expert_names: list[str], rank: int) -> dict:
    """A ZeRO optimizer file with its expert tensors' fragments renamed by expert-parallel rank."""
    experts = set(expert_names)
    try:
        groups = state["optimizer_state_dict"]["param_slice_mappings"]
        state["optimizer_state_dict"]["param_slice_mappings"] = [
            type(group)(
                (f"{name}{RANK_TAG}{rank}" if name in experts else name, where) for name, where in group.items()
            )
            for group in groups
        ]
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"a ZeRO optimizer file of the checkpoint has no parameter slice map: {e!r}") from None
    return state


def _shapes_by_rank(state: dict, expert_names: list[str], ep: int, file_name: str) -> dict:
    """A model-state file whose parameter shapes name each expert tensor once per
    expert-parallel rank (the same shape: each rank holds E/ep experts)."""
    experts = set(expert_names)
    shapes = state.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(group, dict) for group in shapes):
        raise ValueError(f"the checkpoint file {file_name} has no parameter shapes")
    state["param_shapes"] = [
        type(group)(
            (f"{name}{RANK_TAG}{rank}" if name in experts else name, shape)
            for name, shape in group.items()
            for rank in (range(ep) if name in experts else [0])
        )
        for group in shapes
    ]
    return state


def _experts_not_replicated(state: dict, expert_names: list[str]) -> dict:
    """A model-state file whose universal-checkpoint description no longer calls the routed
    experts replicated: with no description, the conversion joins their tensor-parallel slices
    along dim 0, the expert dimension."""
    from deepspeed.checkpoint.constants import (
        AFFINE_MAP,
        AFFINE_MAP_PARAMS,
        TP_REPLICATED_PARAMETER_PATTERNS,
        UNIVERSAL_CHECKPOINT_INFO,
    )

    info = state.get(UNIVERSAL_CHECKPOINT_INFO)
    if not isinstance(info, dict):
        return state

    def expert(pattern) -> bool:
        return isinstance(pattern, str) and any(re.match(pattern, name) for name in expert_names)

    replicated = info.get(TP_REPLICATED_PARAMETER_PATTERNS)
    if isinstance(replicated, list):
        info[TP_REPLICATED_PARAMETER_PATTERNS] = [p for p in replicated if not expert(p)]
    maps = info.get(AFFINE_MAP, {}).get(AFFINE_MAP_PARAMS) if isinstance(info.get(AFFINE_MAP), dict) else None
    if isinstance(maps, dict):
        info[AFFINE_MAP][AFFINE_MAP_PARAMS] = {p: m for p, m in maps.items() if not expert(p)}
    return state


def join_experts(zero_dir: Path, expert_names: list[str], ep: int, tp: int, num_experts: int) -> None:
    """After the conversion: each routed-expert tensor's folder (fp32 value, Adam's moments, the
    step) holds all `num_experts` experts, marked as expert parameters. Under expert parallelism
    without tensor parallelism the conversion wrote one folder per expert-parallel rank; they are
    joined here in rank order."""
    from deepspeed.checkpoint.constants import CAT_DIM, PARAM

    for name in expert_names:
        folder = zero_dir / name
        if not (tp == 1 and ep > 1):
            for path in sorted(folder.glob("*.pt")):
                if path.name != "step.pt":
                    saved = _load(path)
                    torch.save(_marked(saved, saved.get(PARAM), name, path.stem, num_experts), path)
            continue
        parts = [zero_dir / f"{name}{RANK_TAG}{rank}" for rank in range(ep)]
        missing = [part.name for part in parts if not part.is_dir()]
        if missing:
            raise ValueError(
                f"the checkpoint's optimizer files hold no state for {missing[0]}: its experts are not "
                f"split {ep} ways as its train_state.json says"
            )
        shutil.rmtree(folder, ignore_errors=True)  # the conversion's copy of one rank's module value
        folder.mkdir()
        for state_file in sorted(p.name for p in parts[0].glob("*.pt")):
            if state_file == "step.pt":
                shutil.copy2(parts[0] / state_file, folder / state_file)
                continue
            pieces = [_load(part / state_file).get(PARAM) for part in parts]
            rows = num_experts // ep
            if not all(isinstance(piece, torch.Tensor) and piece.dim() >= 1 and len(piece) == rows for piece in pieces):
                raise ValueError(
                    f"the converted checkpoint's {name} {state_file}: each of its {ep} expert-parallel "
                    f"ranks must hold {rows} of the {num_experts} experts"
                )
            joined = torch.cat(pieces, dim=0)
            torch.save(_marked({CAT_DIM: 0}, joined, name, Path(state_file).stem, num_experts), folder / state_file)
        for part in parts:
            shutil.rmtree(part)


def _marked(saved: dict, value, name: str, state: str, num_experts: int) -> dict:
    """A converted expert tensor's file contents with `value` as the tensor, marked as an expert
    parameter of `num_experts` experts (checked: one row per expert on dim 0)."""
    from deepspeed.checkpoint.constants import EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM

    if not isinstance(value, torch.Tensor) or value.dim() < 1 or value.shape[0] != num_experts:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        raise ValueError(
            f"the converted checkpoint's {name} ({state}) has shape {shape}; the model's "
            f"{num_experts} experts need {num_experts} rows on dim 0"
        )
    return {**saved, PARAM: value, EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: num_experts}


def pad_parameter_groups(zero_dir: Path) -> None:
    """DeepSpeed's universal load restores the parameters of those of the engine's parameter
    groups that the checkpoint's list of groups has a counterpart for, by position (a zip). With
    expert parallelism DeepSpeed splits each group into its expert and other parameters, so a run
    that splits its experts has groups that a run without it lacks, and their parameters would
    keep their initial values. The list is padded to twice its length with copies of its last
    group, enough for every group to be split: the load copies a group's settings onto the
    engine's by position, and the engine's own are put back after it
    (checkpointing._mend_universal_load)."""
    path = zero_dir / "optimizer_state.pt"
    state = _load(path)
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise ValueError("the converted checkpoint's optimizer_state.pt holds no parameter groups")
    state["param_groups"] = groups + [dict(groups[-1]) for _ in groups]
    torch.save(state, path)
