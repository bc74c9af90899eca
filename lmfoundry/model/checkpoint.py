"""Model weights and config in and out of a checkpoint directory (safetensors, no pickle). An
adapter checkpoint (lora.py) is loaded as its base checkpoint with the adapter merged in."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lmfoundry.model import lora
from lmfoundry.model.transformer import ModelConfig, Transformer, build_on_meta

WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"
TOKENIZER = "tokenizer.json"
TIED_HEAD = "lm_head.weight"  # the output head, stored once as the embedding when tied


def model_state(model: Transformer, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Owned, contiguous CPU copies (DeepSpeed's parameters are views into flat buffers) of
    `state` (default: the model's own); a tied output head is stored once, as the embedding."""
    state = model.state_dict() if state is None else state
    state = {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
    if model.cfg.tie_embeddings:
        state.pop(TIED_HEAD, None)
    return state


def save_model_files(model: Transformer, directory: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(model_state(model, state), str(directory / WEIGHTS), metadata={"format": "pt"})
    save_model_config(model, directory)


def save_model_config(model: Transformer, directory: str | Path) -> None:
    (Path(directory) / MODEL_CONFIG).write_text(model.cfg.model_dump_json(indent=2))


def save_adapter_files(
    model: Transformer, directory: str | Path, state: dict[str, torch.Tensor], adapter: lora.AdapterRef
) -> None:
    """An adapter checkpoint's model files: the adapter's tensors of `state`, the settings and the
    base reference, and the (merged) model's config."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in lora.adapter_state(state).items()}
    save_file(tensors, str(directory / lora.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    lora.write_adapter_config(directory, adapter)
    (directory / MODEL_CONFIG).write_text(model.cfg.model_dump_json(indent=2))


def load_model_files(
    directory: str | Path, device: str | torch.device = "cpu", base_copies: Mapping[str, str] | None = None
) -> Transformer:
    """A checkpoint's model, whole (an adapter checkpoint merged into its base: `base_copies` as
    `adapter_base` takes them)."""
    directory = Path(directory)
    if lora.is_adapter(directory):
        return load_merged_adapter(directory, base_copies).to(device).eval()
    return load_whole_model(directory).to(device).eval()


def load_whole_model(directory: Path) -> Transformer:
    """The model of a checkpoint that holds all of it, whatever else its directory holds: an
    adapter's base is read so, never as an adapter itself (which would take the base the
    adapter was pinned to elsewhere, or back to the adapter)."""
    cfg = ModelConfig.model_validate(json.loads((directory / MODEL_CONFIG).read_text()))
    check_weights_fit(cfg, directory / WEIGHTS)
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(load_file(str(directory / WEIGHTS)), strict=False)
    allowed_missing = {TIED_HEAD} if cfg.tie_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(
            f"checkpoint {directory} does not fit its model config: missing "
            f"{sorted(set(missing) - allowed_missing)}, unexpected {sorted(unexpected)}"
        )
    return model


def check_weights_fit(cfg: ModelConfig, weights: Path) -> None:
    """The config, from storage, sizes the model: the names and shapes of its state (parameters
    and saved buffers), built on the meta device, checked against the weights file's header
    before anything the config sizes is allocated (a config of a few bytes can claim any size)."""
    from safetensors import safe_open

    expected = {name: tuple(t.shape) for name, t in build_on_meta(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop(TIED_HEAD, None)
    with safe_open(str(weights), framework="pt") as f:
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    if stored != expected:
        wrong = sorted(n for n in expected.keys() & stored.keys() if expected[n] != stored[n])
        raise ValueError(
            f"checkpoint {weights.parent} does not fit its model config: missing "
            f"{sorted(expected.keys() - stored.keys())[:5]}, unexpected {sorted(stored.keys() - expected.keys())[:5]}, "
            f"other shapes {[(n, stored[n], expected[n]) for n in wrong[:5]]}"
        )


def load_model_on_meta(directory: str | Path, base_copies: Mapping[str, str] | None = None) -> Transformer:
    """A checkpoint's model built on the meta device (model/transformer.py build_on_meta), its
    initial values to be read from the checkpoint's weights one tensor at a time when each rank
    materialises its part (train/meta_init.py): no process holds the whole model. The weights
    file is opened, and checked against the config (names and shapes), here: it stays readable
    through its memory map after a caller's temporary copy of the checkpoint is removed. An
    adapter checkpoint reads its base's file so, each adapted projection merged as it is read
    (`base_copies` as `adapter_base` takes them)."""
    from safetensors import safe_open

    directory = Path(directory)
    cfg = ModelConfig.model_validate(json.loads((directory / MODEL_CONFIG).read_text()))
    model = build_on_meta(cfg)
    if lora.is_adapter(directory):
        model.start_weights = MergedAdapterWeights.open(directory, model, base_copies)
    else:
        model.start_weights = safe_open(str(directory / WEIGHTS), framework="pt")
    model.initial_values()  # the checks, now
    return model.train()


class MergedAdapterWeights:
    """An adapter checkpoint's weights as the meta-device build reads them (keys(),
    get_slice(name).get_shape(), get_tensor(name)): its base's safetensors file, each adapted
    projection read as `W + scale * B @ A` in fp32, as `load_merged_adapter` merges it. Base
    tensors are read one at a time; the adapter's own (small) tensors are read whole."""

    class _Shape:
        def __init__(self, shape: list[int]):
            self.shape = shape

        def get_shape(self) -> list[int]:
            return self.shape

    def __init__(self, base, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float):
        self.base, self.pairs, self.scale = base, pairs, scale

    @classmethod
    def open(
        cls, directory: Path, model: Transformer, base_copies: Mapping[str, str] | None = None
    ) -> MergedAdapterWeights:
        """The adapter at `directory` over its base, checked: the base's weights are the ones it
        was trained on, its config is the adapter's, and the adapter fits `model` (built on meta:
        lora.check_adapter_fits)."""
        from safetensors import safe_open

        ref = lora.read_adapter_config(directory)
        with adapter_base(ref, base_copies) as (base_dir, manifest):
            check_adapter_base(directory, ref, manifest)
            base_cfg = json.loads((Path(base_dir) / MODEL_CONFIG).read_text())
            if ModelConfig.model_validate(base_cfg) != model.cfg:
                raise ValueError(f"adapter {directory}: its model config is not its base {ref.base}'s")
            base = safe_open(str(Path(base_dir) / WEIGHTS), framework="pt")  # readable after a copy is removed
        adapter = load_file(str(directory / lora.ADAPTER_WEIGHTS))
        lora.check_adapter_fits(f"{directory} (base {ref.base})", adapter, model, ref.lora)
        pairs = {
            f"{prefix}.weight": (adapter[f"{prefix}.lora_a"], adapter[f"{prefix}.lora_b"])
            for prefix in lora.target_projections(model, ref.lora)
        }
        return cls(base, pairs, ref.lora.alpha / ref.lora.rank)

    def keys(self):
        return self.base.keys()

    def get_slice(self, name: str) -> MergedAdapterWeights._Shape:
        # the shape only: an adapted weight is merged whole, by get_tensor
        return self._Shape(self.base.get_slice(name).get_shape())

    def get_tensor(self, name: str) -> torch.Tensor:
        value = self.base.get_tensor(name).float()  # an fp32 tensor may be a view of the mapped file:
        if name in self.pairs:  # never added to in place, or a second read would merge twice
            value = value + lora.delta(*self.pairs[name], self.scale)
        return value


def check_adapter_base(directory: Path, ref: lora.AdapterRef, base_manifest: dict) -> None:
    """Refused when the adapter's base checkpoint's weights are not the ones it was trained on."""
    if base_sha256(base_manifest, ref.base) != ref.base_sha256:
        raise ValueError(
            f"adapter {directory} was trained on base {ref.base} with weights sha256 {ref.base_sha256[:16]}..., "
            "and that checkpoint's weights have changed since"
        )


def base_sha256(manifest: dict, where: str) -> str:
    """The checksum of a checkpoint's weights, as its (verified) manifest lists it."""
    from lmfoundry.platform.checkpoint import checked_files

    files = checked_files(manifest, where)
    if WEIGHTS not in files:
        raise ValueError(f"{where} has no {WEIGHTS} (an adapter checkpoint): an adapter's base must be a whole model")
    return files[WEIGHTS]["sha256"]


@contextlib.contextmanager
def adapter_base(ref: lora.AdapterRef, base_copies: Mapping[str, str] | None) -> Iterator[tuple[str, dict]]:
    """(local directory, manifest) of an adapter's base checkpoint: the caller's copy of it when
    `base_copies` (a base's URI -> a local directory, e.g. a training run's node copy of the
    checkpoint it started from) holds one, so that every process of a node does not download
    the base again; else a verified temporary copy (or the local checkpoint itself), removed
    after the block. A node's copy (platform/checkpoint.py run_copy: verified when made, in this
    user's private directory) is not hashed again; any other directory is verified here, as
    `opened` would. The adapter's fingerprint of its base is checked by the caller either way."""
    from lmfoundry.platform import storage
    from lmfoundry.platform.checkpoint import CHECKPOINT_MANIFEST, is_run_copy, opened, verify

    local = (base_copies or {}).get(ref.base)
    if local is None:
        with opened(ref.base) as found:
            yield found
        return
    if is_run_copy(local):
        yield local, storage.read_json(str(Path(local) / CHECKPOINT_MANIFEST), storage.MAX_MANIFEST_BYTES)
    else:
        yield local, verify(local, model_only=True)


def load_merged_adapter(directory: Path, base_copies: Mapping[str, str] | None = None) -> Transformer:
    """The adapter's base model (verified against the fingerprint the adapter recorded) with the
    adapter merged into its weights."""
    ref = lora.read_adapter_config(directory)
    base = ref.base
    with adapter_base(ref, base_copies) as (base_dir, manifest):
        check_adapter_base(directory, ref, manifest)
        model = load_whole_model(Path(base_dir))
    if model.cfg != ModelConfig.model_validate(json.loads((directory / MODEL_CONFIG).read_text())):
        raise ValueError(f"adapter {directory}: its model config is not its base {base}'s")
    adapter = load_file(str(directory / lora.ADAPTER_WEIGHTS))
    lora.check_adapter_fits(f"{directory} (base {base})", adapter, model, ref.lora)
    lora.apply_lora(model, ref.lora)
    model.load_state_dict(adapter, strict=False)
    return lora.merge_lora(model)
