"""Malicious checkpoints: crafted manifests, links, pickles and safetensors headers are refused
before anything is written, and training state round-trips without pickle."""

from __future__ import annotations

import ast
import json
import os
import random
import struct
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch
from safetensors.torch import save_file

from lmfoundry.platform import checkpoint, storage

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def tree(root: Path) -> set[str]:
    """Every path under `root` (links included, not followed): what a test compares before/after."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def make_checkpoint(directory: Path, **details) -> Path:
    """A small real checkpoint: safetensors weights, a config, a tokenizer, the manifest last."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(directory / "model.safetensors"))
    (directory / "model_config.json").write_text('{"n_layer": 1}')
    (directory / "tokenizer.json").write_text('{"model": {}}')
    checkpoint.seal(directory, {"step": 1, **details})
    return directory


def rewrite_manifest(directory: Path, edit) -> None:
    manifest = json.loads((directory / checkpoint.CHECKPOINT_MANIFEST).read_text())
    edit(manifest["files"])
    (directory / checkpoint.CHECKPOINT_MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """Temporary copies go under the test's own directory, so leftovers can be counted."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


# --- names in a manifest ----------------------------------------------------------------------

BAD_NAMES = [
    "../../evil",
    "weights/../../evil",
    "/etc/cron.d/evil",
    "C:/Windows/evil.dll",
    "c:evil",
    "deepspeed\\..\\evil",
    "model.safetensors\x00.txt",
    "./model.safetensors",
    "a//b",
    "",
    "a/" * 10 + "deep",
    "..",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_traversal_absolute_backslash_drive_nul_names_are_refused(name):
    with pytest.raises(ValueError, match="checkpoint file name"):
        checkpoint.check_name(name)


@pytest.mark.parametrize("name", ["model.safetensors", "deepspeed/state/mp_rank_00_model_states.pt", "rng-rank-3.json"])
def test_the_names_a_checkpoint_really_has_are_accepted(name):
    assert checkpoint.check_name(name) == name


@pytest.mark.parametrize("evil", ["../../evil", "/ABS/evil"])
def test_download_of_manifest_with_traversal_or_absolute_path_writes_nothing(tmp_path, private_tmp, evil):
    source = make_checkpoint(tmp_path / "remote" / "ckpt")
    outside = tmp_path / "evil"
    evil = evil.replace("/ABS", str(tmp_path))
    (source / "payload").write_bytes(b"owned")
    meta = {"bytes": 5, "sha256": storage.sha256_file(source / "payload")}
    rewrite_manifest(source, lambda files: files.update({evil: meta}))
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="checkpoint file name"):
        checkpoint.copy_down(pafs.LocalFileSystem(), str(source))
    assert not outside.exists()
    assert tree(tmp_path) == before  # the temporary copy is gone too
    assert list(private_tmp.iterdir()) == []


def test_verify_refuses_a_local_manifest_with_traversal(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    (tmp_path / "secret").write_text("not yours")
    meta = {"bytes": 9, "sha256": storage.sha256_file(tmp_path / "secret")}
    rewrite_manifest(ckpt, lambda files: files.update({"../secret": meta}))
    with pytest.raises(ValueError, match="'..'"):
        checkpoint.verify(ckpt)


@pytest.mark.parametrize(
    "meta",
    [{"bytes": -1, "sha256": "0" * 64}, {"bytes": 1, "sha256": "zz"}, {"bytes": True, "sha256": "0" * 64}, "x"],
)
def test_malformed_manifest_entries_are_refused(tmp_path, meta):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    rewrite_manifest(ckpt, lambda files: files.update({"tokenizer.json": meta}))
    with pytest.raises(ValueError, match="must be"):
        checkpoint.verify(ckpt)


def test_manifest_listing_the_manifest_itself_is_refused(tmp_path, private_tmp):
    source = make_checkpoint(tmp_path / "ckpt")
    meta = {"bytes": 1, "sha256": "0" * 64}
    rewrite_manifest(source, lambda files: files.update({"manifest.json": meta}))
    with pytest.raises(ValueError, match="reserved"):
        checkpoint.copy_down(pafs.LocalFileSystem(), str(source))
    assert list(private_tmp.iterdir()) == []


def test_pretrain_manifest_pointing_final_checkpoint_outside_the_run_is_refused(tmp_path):
    make_checkpoint(tmp_path / "elsewhere")
    run = tmp_path / "run"
    storage.commit(str(run), "pretrain", {"final_checkpoint": "../elsewhere"})
    with pytest.raises(ValueError, match="'..'"):
        checkpoint.resolve(str(run))


# --- links ------------------------------------------------------------------------------------


def test_symlink_to_etc_passwd_in_a_local_checkpoint_is_refused(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer.json").symlink_to("/etc/passwd")
    checkpoint.seal(ckpt, {"step": 1})  # the manifest matches the linked content: only the link is wrong
    with pytest.raises(ValueError, match="symbolic link"):
        checkpoint.verify(ckpt, model_only=True)


def test_unlisted_symlink_in_a_checkpoint_is_refused(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    (ckpt / "chat_template.jinja").symlink_to("/etc/passwd")  # a name loaders open without the manifest
    with pytest.raises(ValueError, match="symbolic link"):
        checkpoint.verify(ckpt)


def test_symlinked_directory_in_a_downloaded_checkpoint_is_refused(tmp_path, private_tmp):
    source = make_checkpoint(tmp_path / "ckpt")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "state.bin").write_bytes(b"x")
    (source / "deepspeed").symlink_to(tmp_path / "outside", target_is_directory=True)
    meta = {"bytes": 1, "sha256": storage.sha256_file(tmp_path / "outside" / "state.bin")}
    rewrite_manifest(source, lambda files: files.update({"deepspeed/state.bin": meta}))
    with pytest.raises(ValueError, match="symbolic link"):
        checkpoint.copy_down(pafs.LocalFileSystem(), str(source))
    assert list(private_tmp.iterdir()) == []


def test_a_clean_download_has_exactly_the_listed_files_and_opened_removes_it(tmp_path, private_tmp):
    source = make_checkpoint(tmp_path / "ckpt")
    (source / "stray.txt").write_text("not in the manifest")
    copy = Path(checkpoint.copy_down(pafs.LocalFileSystem(), str(source)))
    assert copy.parent == private_tmp
    assert tree(copy) == {"manifest.json", "model.safetensors", "model_config.json", "tokenizer.json"}
    assert checkpoint.verify(copy)["step"] == 1


def test_opened_removes_nothing_of_a_local_checkpoint_and_verifies_it(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    with checkpoint.opened(str(ckpt)) as (local, manifest):
        assert local == str(ckpt) and manifest["step"] == 1
    assert (ckpt / "model.safetensors").exists()
    (ckpt / "model_config.json").write_text('{"n_layer": 2}')
    with pytest.raises(ValueError, match="checksum"):
        with checkpoint.opened(str(ckpt)):
            pass


# --- pickles --------------------------------------------------------------------------------


class _RunsCodeOnLoad:
    """Unpickling this creates the marker file: the payload of a malicious .pt."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_in_a_pt_file_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "rng-rank-0.pt"
    torch.save({"torch": torch.zeros(2), "x": _RunsCodeOnLoad(str(marker))}, evil)
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        checkpoint.torch_load_weights(evil)
    assert not marker.exists()
    # the payload is live: a pickle-trusting load runs it
    torch.load(evil, weights_only=False)
    assert marker.exists()


def test_deepspeed_optimizer_file_with_a_pickle_payload_does_not_run_on_resume(tmp_path):
    """DeepSpeed's own checkpoint engine loads with weights_only=False; the training loop's
    engine (train/snapshot.py) takes its place for every load DeepSpeed makes on resume."""
    from lmfoundry.train.snapshot import SnapshotCheckpointEngine

    marker = tmp_path / "pwned"
    evil = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _RunsCodeOnLoad(str(marker))}, evil)
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        SnapshotCheckpointEngine().load(str(evil))
    assert not marker.exists()


def test_universal_conversion_of_a_crafted_checkpoint_runs_no_pickle(tmp_path):
    """Resuming at another world size converts the checkpoint with DeepSpeed's own converter,
    which loads with weights_only=False; lmfoundry runs it with weights-only loads forced."""
    import os
    import subprocess
    import sys

    from lmfoundry.train.checkpointing import WEIGHTS_ONLY_UNIVERSAL_CONVERSION

    marker, state = tmp_path / "pwned", tmp_path / "state"
    state.mkdir()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"payload": _RunsCodeOnLoad(str(marker))}, state / name)
    done = subprocess.run(
        [sys.executable, "-c", WEIGHTS_ONLY_UNIVERSAL_CONVERSION, "--input_folder", str(state)]
        + ["--output_folder", str(tmp_path / "out"), "--num_extract_workers", "1", "--num_merge_workers", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1", "PYTHONPATH": str(REPO)},
    )
    assert done.returncode != 0
    assert "Weights only load failed" in done.stderr or "Unsupported global" in done.stderr, done.stderr[-2000:]
    assert not marker.exists()


def _zero_checkpoint(
    folder: Path,
    names,
    container=list,
    optimizer_file="zero_pp_rank_0_mp_rank_00_optim_states.pt",
    model_file="mp_rank_00_model_states.pt",
    **model_state,
) -> Path:
    """A one-rank ZeRO-1 checkpoint folder as DeepSpeed's converter reads it, with `names` as its
    parameters' names (4 elements each), the slice maps and shapes in `container`."""
    from collections import OrderedDict

    from deepspeed.utils.tensor_fragment import fragment_address

    folder.mkdir(parents=True, exist_ok=True)
    total = 4 * len(names)
    optimizer = {
        "zero_stage": 1,
        "param_slice_mappings": container([OrderedDict((n, fragment_address(4, 4 * i)) for i, n in enumerate(names))]),
        "single_partition_of_fp32_groups": [torch.ones(total)],
        "base_optimizer_state": {
            "state": {0: {"exp_avg": torch.zeros(total), "exp_avg_sq": torch.zeros(total), "step": 1}},
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
        "partition_count": [1],
        "group_paddings": [0],
    }
    torch.save({"optimizer_state_dict": optimizer}, folder / optimizer_file)
    shapes = container([OrderedDict((n, torch.Size([4])) for n in names)])
    module = OrderedDict((n, torch.ones(4)) for n in names)
    torch.save({"param_shapes": shapes, "module": module, "iteration": 1, **model_state}, folder / model_file)
    return folder


def test_a_crafted_checkpoint_cannot_lead_a_layout_move_out_of_its_folder(tmp_path):
    """Parameter names become folders in DeepSpeed's conversion. Hidden where a check of lists
    would not look (a tuple, a map of groups), in a file lmfoundry does not recognise but the
    converter reads, or past lmfoundry's check altogether: each is refused, by lmfoundry's check
    or by the converter's confinement to its output folder, and nothing is written outside."""
    import subprocess
    import sys

    from lmfoundry.train.checkpointing import WEIGHTS_ONLY_UNIVERSAL_CONVERSION
    from lmfoundry.train.expert_checkpoint import prepare_for_conversion

    outside = tmp_path / "outside"
    escape = "../" * 12 + str(outside).lstrip("/")  # from any folder, up to the root and down to `outside`
    # the names in a tuple, in a map of groups, and in files of names lmfoundry does not recognise
    for folder in (
        _zero_checkpoint(tmp_path / "tuple", [escape], container=tuple),
        _zero_checkpoint(tmp_path / "map", [escape], container=lambda groups: dict(enumerate(groups))),
        _zero_checkpoint(
            tmp_path / "name",
            [escape],
            optimizer_file="zero_pp_rank_0_mp_rank_00_X_optim_states.pt",
            model_file="mp_rank_00_X_model_states.pt",
        ),
    ):
        for ep, tp in ((1, 1), (2, 1), (2, 2)):
            experts = ["blocks.0.mlp.w_gate_up"] if ep > 1 else []
            with pytest.raises(ValueError, match="not a list of dicts|would read as one of its files"):
                prepare_for_conversion(folder, tmp_path / f"input-{folder.name}-{ep}-{tp}", experts, ep=ep, tp=tp)
    # lmfoundry's check passed by: the converter itself refuses to write outside its folder
    state = _zero_checkpoint(tmp_path / "unchecked", [escape])
    done = subprocess.run(
        [sys.executable, "-c", WEIGHTS_ONLY_UNIVERSAL_CONVERSION, "--input_folder", str(state)]
        + ["--output_folder", str(tmp_path / "out" / "state"), "--num_extract_workers", "1"]
        + ["--num_merge_workers", "1", "--inject_missing_state"],  # as a move runs it (checkpointing._convert)
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1", "PYTHONPATH": str(REPO)},
    )
    assert done.returncode != 0
    assert "the conversion writes only under its output folder" in done.stderr, done.stderr[-2000:]
    assert not outside.exists()


def test_a_crafted_universal_description_cannot_stall_a_move(tmp_path):
    """The converter matches every pattern of a checkpoint's universal description against every
    parameter name: a pattern other than a literal name (this one backtracks for minutes) is
    refused before the conversion runs, as is a description in other containers."""
    import time

    from lmfoundry.train.expert_checkpoint import prepare_for_conversion

    stalls = {"tp_replicated_parameter_patterns": [r"^(([\w.]+)+)+!"]}
    for label, info in {
        "a backtracking pattern": stalls,
        "a wildcard": {"parameter_to_average_patterns": [r"^.*$"]},
        "an affine map's key": {"affine_map": {"version": 1, "params": {r"^(\w+)+!": {}}}},
        "a tuple of patterns": {"tp_replicated_parameter_patterns": (r"^norm\.weight$",)},
        "sub-parameters' patterns": {"parameter_with_sub_params": [{"patterns": [r"^(a|aa)+$"]}]},
    }.items():
        folder = _zero_checkpoint(tmp_path / label.replace(" ", "-"), ["norm.weight"], universal_checkpoint_info=info)
        started = time.monotonic()
        with pytest.raises(ValueError, match="parameter pattern|is not a"):
            prepare_for_conversion(folder, tmp_path / f"input-{label.replace(' ', '-')}", [], ep=1, tp=1)
        assert time.monotonic() - started < 5, label
    fine = {
        "tp_replicated_parameter_patterns": [r"^norm\.weight$"],
        "affine_map": {"params": {r"^blocks\.0\.attn\.wq\.weight$": {}}},
    }
    folder = _zero_checkpoint(tmp_path / "fine", ["norm.weight"], universal_checkpoint_info=fine, ds_autoep_layers=None)
    prepare_for_conversion(folder, tmp_path / "input-fine", [], ep=1, tp=1)
    # DeepSpeed's own expert layers, whose description its converter would follow: lmfoundry
    # writes none (DeepSpeed writes the key with no value, as above)
    folder = _zero_checkpoint(tmp_path / "autoep", ["norm.weight"], ds_autoep_layers=[{"name": "blocks.0.mlp"}])
    with pytest.raises(ValueError, match="describes ds_autoep_layers, which lmfoundry never writes"):
        prepare_for_conversion(folder, tmp_path / "input-autoep", [], ep=1, tp=1)


@pytest.mark.parametrize(
    "position",
    [{"step": "10"}, {"step": -1}, {"epoch": 1.5}, {"batches_in_epoch": True}, {"batches_in_epoch": None}],
)
def test_a_training_states_position_must_be_non_negative_integers(position):
    """Resume multiplies and divides the position by the layouts' sizes: a string, a float or a
    negative number from storage is refused first."""
    from lmfoundry.train.checkpointing import _check_position

    with pytest.raises(ValueError, match="must be a non-negative integer"):
        _check_position({"step": 10, "epoch": 0, "batches_in_epoch": 20, **position}, "run/checkpoints/step-00000010")


def test_a_training_states_layout_past_any_run_is_refused():
    from lmfoundry.train.checkpointing import MAX_WORLD_SIZE, _written_layout

    assert _written_layout({"world_size": MAX_WORLD_SIZE}, "uri") == (MAX_WORLD_SIZE, 1, 1, 1)
    with pytest.raises(ValueError, match="at most"):
        _written_layout({"world_size": 10**30}, "uri")


def _torch_load_calls(path: Path) -> list[tuple[int, bool]]:
    """(line, passes weights_only=True) of every torch.load call in a source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
            safe = any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords
            )
            found.append((node.lineno, safe))
    return found


def _unsafe_torch_loads(under: Path) -> list[str]:
    return [
        f"{p.relative_to(REPO)}:{line}"
        for p in sorted(under.rglob("*.py"))
        for line, safe in _torch_load_calls(p)
        if not safe
    ]


def test_every_torch_load_outside_train_is_weights_only():
    unsafe = [u for u in _unsafe_torch_loads(REPO / "lmfoundry") if not u.startswith("lmfoundry/train/")]
    assert unsafe == []
    # the scan sees calls at all: the platform's own loader is one, and it is safe
    assert [safe for _, safe in _torch_load_calls(REPO / "lmfoundry" / "platform" / "checkpoint.py")] == [True]


def test_every_torch_load_in_train_is_weights_only():
    assert _unsafe_torch_loads(REPO / "lmfoundry" / "train") == []


# --- safetensors headers ----------------------------------------------------------------------


def _lying_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + n :])


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda h: h["w"].update(data_offsets=[0, 1 << 40]), "claims bytes"),
        (lambda h: h["w"].update(shape=[2, 3000000]), "claims bytes"),
        (lambda h: h["w"].update(dtype="F64"), "claims bytes"),
        (lambda h: h["w"].update(dtype="OBJECT"), "dtype"),
        (lambda h: h.update(v={"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}), "overlap"),
        (lambda h: h["w"].update(shape=[-2, -3]), "sizes >= 0"),
    ],
)
def test_safetensors_header_lying_about_sizes_is_refused(tmp_path, edit, message):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    _lying_header(ckpt / "model.safetensors", edit)
    checkpoint.seal(ckpt, {"step": 1})  # the attacker writes the manifest too
    with pytest.raises(ValueError, match=message):
        checkpoint.verify(ckpt)


def test_safetensors_header_length_past_the_end_is_refused(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    raw = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + raw[8:])
    checkpoint.seal(ckpt, {"step": 1})
    with pytest.raises(ValueError, match="runs past the end"):
        checkpoint.verify(ckpt)


def test_an_honest_safetensors_file_passes():
    with tempfile.TemporaryDirectory() as d:
        save_file(
            {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(0), "c": torch.ones(2, 2)}, f"{d}/m.safetensors"
        )
        checkpoint.check_safetensors(f"{d}/m.safetensors")


# --- training state without pickle ----------------------------------------------------------


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_rng_state_round_trips_through_json_and_safetensors(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draws()
    checkpoint.save_rng_state(tmp_path, suffix="-rank-0")
    expected = _draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.load_rng_state(tmp_path, suffix="-rank-0")
    assert _draws() == expected
    assert sorted(os.listdir(tmp_path)) == ["rng-rank-0.json", "rng-rank-0.safetensors"]
    json.loads((tmp_path / "rng-rank-0.json").read_text())  # plain JSON, no pickle anywhere
    assert b"\x80\x04" not in (tmp_path / "rng-rank-0.safetensors").read_bytes()[:16]


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s["python"].update(internal="not a state"),
        lambda s: s["numpy"].update(keys=[1, 2]),
        lambda s: s.pop("python"),
        lambda s: s["numpy"].update(kind={"__reduce__": "os.system"}),
    ],
)
def test_crafted_rng_state_is_a_clear_error(tmp_path, edit):
    checkpoint.save_rng_state(tmp_path)
    state = json.loads((tmp_path / "rng.json").read_text())
    edit(state)
    (tmp_path / "rng.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="malformed RNG state"):
        checkpoint.load_rng_state(tmp_path)


def test_torch_rng_tensor_of_the_wrong_kind_is_refused(tmp_path):
    checkpoint.save_rng_state(tmp_path)
    save_file({"torch": torch.zeros(4, dtype=torch.float32)}, str(tmp_path / "rng.safetensors"))
    with pytest.raises(ValueError, match="uint8"):
        checkpoint.load_rng_state(tmp_path)


def test_json_state_refuses_what_json_cannot_hold(tmp_path):
    checkpoint.save_json_state(tmp_path / "train_state.json", {"step": 3, "epoch": 0})
    assert checkpoint.load_json_state(tmp_path / "train_state.json") == {"step": 3, "epoch": 0}
    with pytest.raises(ValueError):
        checkpoint.save_json_state(tmp_path / "bad.json", {"loss": float("nan")})
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        checkpoint.load_json_state(tmp_path / "list.json")


# --- pack outputs -----------------------------------------------------------------------------


def make_pack(directory: Path, **manifest) -> Path:
    """A pack output's tokenizer and manifest (the shards are not read before these are checked)."""
    from tokenizers import Tokenizer, models

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).to_str())
    details = {
        "tokenizer": "tokenizer.json",
        "vocab_size": 2,
        "seq_len": 16,
        "sequences_per_shard": 64,
        "rows_per_group": 8,
        "splits": {"train": {"shards": 1, "sequences": 64}, "val": {"shards": 1, "sequences": 8}},
        **manifest,
    }
    storage.commit(str(directory), "pack", details)
    return directory


def pretrain_on(data: Path, out: Path):
    from lmfoundry.train.config import PretrainConfig
    from lmfoundry.train.pretrain import run_pretrain

    return run_pretrain(PretrainConfig(data=str(data), output=str(out)))


@pytest.mark.parametrize(
    "manifest, message",
    [
        ({"tokenizer": "../secret.txt"}, "names the tokenizer '../secret.txt'"),
        ({"tokenizer": "/etc/passwd"}, "names the tokenizer '/etc/passwd'"),
        ({"vocab_size": 1}, "vocab_size=1 in its manifest; an integer from its tokenizer's 2"),
        ({"vocab_size": 10**12}, "vocab_size=1000000000000"),
        ({"seq_len": "16"}, "seq_len='16'"),
        ({"seq_len": 2**40}, "seq_len=1099511627776"),
        ({"rows_per_group": 0}, "rows_per_group=0 in its manifest; a positive integer"),
        ({"splits": {"train": {"shards": 10**8, "sequences": 64 * 10**8}}}, "at most 1,000,000"),
        ({"splits": {"train": {"shards": 3, "sequences": 64}}}, "do not fill 3 shards of 64"),
        (
            {
                "sequences_per_shard": 10**12,
                "rows_per_group": 1,
                "splits": {"train": {"shards": 1, "sequences": 10**12}},
            },
            "row groups a shard",
        ),
        ({"splits": {"train": {"shards": True, "sequences": 64}}}, "shards=True"),
        ({"splits": []}, "no 'train' split"),
    ],
)
def test_a_crafted_pack_manifest_is_refused_before_anything_is_read_or_written(tmp_path, manifest, message):
    """A pack output's manifest names its tokenizer, which pretraining copies into every
    checkpoint: a name leading out of the directory would publish any file the run can read.
    Its counts size the model and the workers' file lists: each is checked first."""
    (tmp_path / "secret.txt").write_text("AWS_SECRET_ACCESS_KEY=hunter2")
    data = make_pack(tmp_path / "packed", **manifest)
    with pytest.raises(ValueError, match=message):
        pretrain_on(data, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_pack_tokenizer_that_is_a_link_or_not_a_tokenizer_is_refused(tmp_path):
    (tmp_path / "secret.txt").write_text('{"not": "a tokenizer"}')
    data = make_pack(tmp_path / "packed")
    (data / "tokenizer.json").unlink()
    (data / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(ValueError, match="tokenizer.json is a symbolic link"):
        pretrain_on(data, tmp_path / "run")
    (data / "tokenizer.json").unlink()
    os.mkfifo(data / "tokenizer.json")  # a read that would never end
    with pytest.raises(ValueError, match="not a regular file"):
        pretrain_on(data, tmp_path / "run")
    (data / "tokenizer.json").unlink()
    (data / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="not a usable tokenizer"):
        pretrain_on(data, tmp_path / "run")
    (data / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="not a usable tokenizer"):
        pretrain_on(data, tmp_path / "run")
    storage.write_json_atomic(str(data / "_MANIFEST.json"), ["a", "list"])
    with pytest.raises(ValueError, match="not a JSON object"):
        pretrain_on(data, tmp_path / "run")
    assert not (tmp_path / "run").exists()


# --- adapters and their bases -----------------------------------------------------------------


def tiny_checkpoints(root: Path, seeds: dict[str, int], **config):
    """Sealed whole checkpoints of a 1-layer model, by name, each with weights of its seed."""
    from lmfoundry.model.checkpoint import save_model_files
    from lmfoundry.model.transformer import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=16, max_seq_len=16, n_layer=1, d_model=16, n_head=2, n_kv_head=1, **config)
    models = {}
    for name, seed in seeds.items():
        torch.manual_seed(seed)
        models[name] = Transformer(cfg)
        save_model_files(models[name], root / name)
        checkpoint.seal(root / name, {"step": 0})
    return models


def make_adapter(directory: Path, base: Path, seed: int = 0) -> None:
    """A sealed LoRA adapter checkpoint over `base`, pinned to its weights' checksum."""
    from lmfoundry.model import lora
    from lmfoundry.model.checkpoint import WEIGHTS, load_model_files, save_adapter_files

    torch.manual_seed(seed)
    model = load_model_files(base)
    settings = lora.LoraConfig(rank=2, targets=["wq"])
    lora.apply_lora(model, settings)
    for name, p in model.named_parameters():
        if name.endswith("lora_b"):
            p.data.normal_()
    sha = json.loads((base / "manifest.json").read_text())["files"][WEIGHTS]["sha256"]
    save_adapter_files(model, directory, model.state_dict(), lora.AdapterRef(settings, str(base), sha))
    checkpoint.seal(directory, {"step": 0})


def test_an_adapters_base_is_read_as_a_whole_model_whatever_else_its_directory_holds(tmp_path):
    """An adapter pins its base by the checksum of the base's weights. Files added to the base
    (an adapter config naming another base) do not make the base an adapter over that one, and a
    checkpoint that names itself as its base loads once, not forever."""
    from lmfoundry.model.checkpoint import load_model_files

    models = tiny_checkpoints(tmp_path, {"base": 1, "evil": 666})
    make_adapter(tmp_path / "adapter", tmp_path / "base")
    honest = load_model_files(tmp_path / "adapter")
    make_adapter(tmp_path / "over-evil", tmp_path / "evil", seed=5)
    for name in ("adapter_config.json", "adapter.safetensors"):  # unlisted in the base's manifest
        (tmp_path / "base" / name).write_bytes((tmp_path / "over-evil" / name).read_bytes())
    merged = load_model_files(tmp_path / "adapter")
    assert torch.equal(merged.embed.weight, models["base"].embed.weight)
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), honest.state_dict().values()))
    # the base now names itself: read as a whole model, it loads once
    looped = tmp_path / "loop"
    tiny_checkpoints(tmp_path, {"loop": 2})
    make_adapter(tmp_path / "over-loop", looped)
    for name in ("adapter_config.json", "adapter.safetensors"):
        (looped / name).write_bytes((tmp_path / "over-loop" / name).read_bytes())
    (looped / "manifest.json").unlink()
    checkpoint.seal(looped, {"step": 0})
    load_model_files(looped)


def test_an_adapter_over_a_base_whose_config_changed_is_refused(tmp_path):
    """The base's weights are pinned by checksum, its config by the adapter's own copy of it."""
    from lmfoundry.model.checkpoint import load_model_files, load_model_on_meta

    tiny_checkpoints(tmp_path, {"base": 1})
    make_adapter(tmp_path / "adapter", tmp_path / "base")
    config = json.loads((tmp_path / "base" / "model_config.json").read_text())
    (tmp_path / "base" / "model_config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    (tmp_path / "base" / "manifest.json").unlink()
    checkpoint.seal(tmp_path / "base", {"step": 0})
    for load in (load_model_files, load_model_on_meta):
        with pytest.raises(ValueError, match="its model config is not its base"):
            load(tmp_path / "adapter")


def test_a_model_config_cannot_claim_rotary_tables_its_weights_do_not_pay_for():
    """The rotary tables (max_seq_len x head_dim) are made when the model is built and are not
    in the weights file, so the header check cannot bound them: the config does. A 0.5 MB
    checkpoint of one 8,192-wide head at 2 million positions asked for 64 GiB."""
    from pydantic import ValidationError

    from lmfoundry.model.transformer import ModelConfig

    shape = dict(vocab_size=16, n_layer=1, d_model=8, n_head=1, n_kv_head=1, ffn_hidden_size=8)
    with pytest.raises(ValidationError, match="largest rotary tables"):
        ModelConfig(max_seq_len=2**21, attention_head_dim=8192, **shape)
    with pytest.raises(ValidationError, match="less than or equal to 2097152"):
        ModelConfig(max_seq_len=2**21 + 1, **shape)
    ModelConfig(max_seq_len=2**20, attention_head_dim=256, **shape)  # a million positions at Gemma's heads
