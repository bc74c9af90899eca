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

import pickle
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
# a pipeline's per-layer files
_LAYER_FILE = re.compile(r"layer_\d+-model_\d+-model_states\.pt")
# what DeepSpeed's converter takes for one of its files (ds_to_universal, DeepSpeedCheckpoint): a
# file it would read must be one of the three above, whose contents are checked
_READ_BY_CONVERTER = re.compile(
    r"(?:(?:bf16_|fp16_)?zero_pp_rank_|mp_rank_|layer_).*|.*(?:_optim_states|model_states)\.pt"
)
# a parameter's name as torch writes it; the conversion makes a folder of each name it reads
_PARAMETER_NAME = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")
# a parameter's pattern in a universal-checkpoint description as DeepSpeed's AutoTP writes it
# (rf"^{re.escape(name)}$"): the converter matches each against every name, so anything but a
# literal name could take it any time (a crafted `^(\w+)+!`)
_PARAMETER_PATTERN = re.compile(r"\^[A-Za-z0-9_]+(?:\\\.[A-Za-z0-9_]+)*\$")


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
    """A checkpoint file, weights-only; with `mmap` its tensors mapped rather than read, where
    torch can map them (else, a file not in torch's zip format, a file system that cannot map or a
    damaged record, it is read, and torch's reading says what is wrong)."""
    import zipfile

    from lmfoundry.train.snapshot import load_deepspeed_file

    mapped = mmap and zipfile.is_zipfile(path)
    try:
        state = load_deepspeed_file(path, "cpu", mapped)
    except pickle.UnpicklingError:
        raise  # weights-only refused it: torch's message names what it would have run
    except Exception as e:
        if mapped:
            return _load(path)
        raise ValueError(f"the checkpoint file {path.name} cannot be read: {type(e).__name__}: {e}") from e
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
        layer_file = _LAYER_FILE.fullmatch(path.name)
        checkpoint_file = optimizer_file or model_state_file or layer_file
        if _READ_BY_CONVERTER.fullmatch(path.name) and not checkpoint_file:
            raise ValueError(
                f"the checkpoint's folder holds {path.name!r}, which DeepSpeed's conversion would read as one of "
                "its files; a checkpoint's are zero_pp_rank_*_mp_rank_*_optim_states.pt, mp_rank_*_model_states.pt "
                "and layer_*-model_*-model_states.pt"
            )
        if checkpoint_file and (path.is_symlink() or not path.is_file()):
            raise ValueError(f"the checkpoint file {path.name} is not a regular file")
        if not split:
            change = None
        elif tp == 1:  # expert parallelism: each rank's experts renamed, their shapes named per rank
            change = "rename" if optimizer_file else "shapes" if model_state_file else None
        else:  # tensor parallelism: the experts out of the replicated description
            change = "unreplicate" if model_state_file else None
        if checkpoint_file:
            # a file the conversion reads as it is (a link) is mapped, not read: only its names are
            # checked here, and DeepSpeed's converter is the one to read its tensors
            state = _load(path, mmap=change is None)
            if layer_file:  # a layer's own state dict
                _check_names({"module": state}, path.name)
            else:
                _check_names(state, path.name)
        if change == "rename":
            # the expert-parallel groups are ep consecutive data-parallel ranks (of a stage)
            torch.save(_renamed_fragments(state, expert_names, int(optimizer_file[1]) % ep), out / path.name)
        elif change == "shapes":
            torch.save(_shapes_by_rank(state, expert_names, ep, path.name), out / path.name)
        elif change == "unreplicate":
            torch.save(_experts_not_replicated(state, expert_names), out / path.name)
        else:
            (out / path.name).symlink_to(path.resolve())
    return out


def _check_names(state: dict, file_name: str) -> None:
    """Refuses a file whose parameter names (its ZeRO slice map's, its shapes', its module's)
    are not torch's dotted names."""
    from deepspeed.checkpoint.constants import AUTOEP_LAYERS_KEY, AUTOEP_LAYERS_KEY_LEGACY, UNIVERSAL_CHECKPOINT_INFO

    def groups(owner: dict, key: str) -> list[dict]:
        # where the file has them, a list of dicts (a weights-only load makes no other subclass):
        # DeepSpeed's converter indexes any sequence or mapping, so a tuple or a mapping of groups
        # would carry names past this check
        value = owner.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(group, dict) for group in value):
            raise ValueError(f"the checkpoint file {file_name}: {key} is not a list of dicts")
        return value

    optimizer = state.get("optimizer_state_dict")
    names = [n for group in groups(state, "param_shapes") for n in group]
    if optimizer is not None:
        if not isinstance(optimizer, dict):
            raise ValueError(f"the checkpoint file {file_name}: optimizer_state_dict is not a dict")
        names += [n for group in groups(optimizer, "param_slice_mappings") for n in group]
    module = state.get("module")
    if module is not None:
        if not isinstance(module, dict):
            raise ValueError(f"the checkpoint file {file_name}: module is not a dict")
        names += list(module)
    for name in names:
        if not isinstance(name, str) or not _PARAMETER_NAME.fullmatch(name):
            raise ValueError(
                f"the checkpoint file {file_name} names a parameter {name!r}; a parameter's name is "
                "dot-separated letters, digits and underscores"
            )
    # DeepSpeed's own expert layers (AutoEP), whose description the converter follows: never
    # lmfoundry's (DeepSpeed writes the key with no value)
    for key in (AUTOEP_LAYERS_KEY, AUTOEP_LAYERS_KEY_LEGACY):
        if state.get(key) is not None:
            raise ValueError(f"the checkpoint file {file_name} describes {key}, which lmfoundry never writes")
    if UNIVERSAL_CHECKPOINT_INFO in state:
        _check_patterns(state[UNIVERSAL_CHECKPOINT_INFO], file_name)


def _check_patterns(info, file_name: str) -> None:
    """Refuses a universal-checkpoint description any of whose parameter patterns is not a literal
    name (see _PARAMETER_PATTERN), or whose lists and maps of them are other containers."""
    from deepspeed.checkpoint import constants as c

    if not isinstance(info, dict):
        raise ValueError(f"the checkpoint file {file_name}: {c.UNIVERSAL_CHECKPOINT_INFO} is not a dict")
    patterns = []

    def take(key: str, value, kind: type) -> None:
        if not isinstance(value, kind):
            raise ValueError(f"the checkpoint file {file_name}: {key} is not a {kind.__name__}")
        patterns.extend(value)

    for key in (
        c.VOCABULARY_PARAMETER_PATTERNS,
        c.PIPELINE_REPLICATED_PARAMETER_PATTERNS,
        c.PARAMETER_TO_AVERAGE_PATTERNS,
        c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
        c.TP_REPLICATED_PARAMETER_PATTERNS,
        c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    ):
        if key in info:
            take(key, info[key], list)
    for key in (c.AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, c.SUB_PARAM_SHARD_WIDTHS):
        if key in info:
            take(key, info[key], dict)
    if c.PARAMETER_WITH_SUB_PARAMS in info:
        sub_params = info[c.PARAMETER_WITH_SUB_PARAMS]
        if not isinstance(sub_params, list) or not all(isinstance(entry, dict) for entry in sub_params):
            raise ValueError(f"the checkpoint file {file_name}: {c.PARAMETER_WITH_SUB_PARAMS} is not a list of dicts")
        for entry in sub_params:
            take(c.PARAMETER_WITH_SUB_PARAMS, entry.get("patterns", []), list)
    if c.AFFINE_MAP in info:
        affine = info[c.AFFINE_MAP]
        if not isinstance(affine, dict):
            raise ValueError(f"the checkpoint file {file_name}: {c.AFFINE_MAP} is not a dict")
        take(c.AFFINE_MAP, affine.get(c.AFFINE_MAP_PARAMS, {}), dict)
    for pattern in patterns:
        if not isinstance(pattern, str) or not _PARAMETER_PATTERN.fullmatch(pattern):
            raise ValueError(
                f"the checkpoint file {file_name} holds a parameter pattern {pattern!r}; a pattern is a "
                "parameter's name, its dots escaped, between ^ and $"
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
