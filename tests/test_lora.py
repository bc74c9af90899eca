"""LoRA on lmfoundry's own model and on an imported one: only the adapters train, an adapter
checkpoint holds the adapter and a fingerprinted reference to its base, and loading or exporting
it merges the adapter in with the adapted model's logits."""

import json
import shutil

import pytest
import torch
from test_export import make_checkpoint
from test_hf_import import SMALL, build_hf

from lmfoundry.jobs.import_model import main as import_main
from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE
from lmfoundry.model.checkpoint import (
    MODEL_CONFIG,
    TOKENIZER,
    WEIGHTS,
    base_sha256,
    load_model_files,
    load_model_on_meta,
    save_adapter_files,
)
from lmfoundry.model.lora import ADAPTER_WEIGHTS, AdapterRef, LoraConfig, LoRALinear, apply_lora
from lmfoundry.model.tokenizer import SPECIAL_TOKENS_FILE
from lmfoundry.platform import checkpoint
from lmfoundry.train.engine import param_groups


def base_checkpoint(tmp_path, kind):
    if kind == "own":
        make_checkpoint(tmp_path / "base")
    else:
        from transformers import LlamaConfig

        src = build_hf(tmp_path / "hf", LlamaConfig(**SMALL, tie_word_embeddings=False), "")
        assert import_main(["hf", str(src), str(tmp_path / "base")]) == 0
    return tmp_path / "base"


@pytest.mark.parametrize("kind", ["own", "imported"])
def test_lora_trains_only_adapters_and_its_checkpoint_loads_and_exports_merged(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    from lmfoundry.model.export import export_hf

    base = base_checkpoint(tmp_path, kind)
    before = (base / WEIGHTS).read_bytes()
    cfg = LoraConfig(rank=4, alpha=8, targets=["wq", "wkv", "wo", "w_gate_up", "w_down"])
    torch.manual_seed(0)
    model = apply_lora(load_model_files(base).train(), cfg)
    x = torch.randint(0, model.cfg.vocab_size, (2, 24))
    with torch.no_grad():  # B starts at zero: the adapted model is the base model
        torch.testing.assert_close(model(x)[0], load_model_files(base)(x)[0], atol=0, rtol=0)

    groups = param_groups(model, weight_decay=0.0)
    trained = {id(p) for g in groups for p in g["params"]}
    adapters = {n for n, p in model.named_parameters() if id(p) in trained}
    assert adapters == {n for n, _ in model.named_parameters() if n.endswith((".lora_a", ".lora_b"))}
    assert len(adapters) == 2 * 5 * model.cfg.n_layer
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in trained}
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    for _ in range(3):
        loss = model(x[:, :-1], x[:, 1:])[1]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # bitwise
    assert all(bool(m.lora_b.abs().sum()) for m in model.modules() if isinstance(m, LoRALinear))

    adapter_dir = tmp_path / "adapter"
    ref = AdapterRef(cfg, str(base), base_sha256(checkpoint.verify(str(base)), str(base)))
    save_adapter_files(model, adapter_dir, model.state_dict(), ref)
    for name in (TOKENIZER, SPECIAL_TOKENS_FILE, CHAT_TEMPLATE_FILE):  # as training writes them
        if (base / name).exists():
            (adapter_dir / name).write_bytes((base / name).read_bytes())
    checkpoint.seal(adapter_dir, {"step": 3})
    assert not (adapter_dir / WEIGHTS).exists()
    assert (adapter_dir / ADAPTER_WEIGHTS).stat().st_size < len(before) / 4  # the adapter only
    model.eval()
    with torch.no_grad():
        adapted = model(x)[0]
        torch.testing.assert_close(load_model_files(adapter_dir)(x)[0], adapted, atol=1e-5, rtol=0)
        export_hf(adapter_dir, tmp_path / "export")
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
        torch.testing.assert_close(hf(x).logits, adapted, atol=1e-5, rtol=0)
    assert (base / WEIGHTS).read_bytes() == before
    # built on the meta device (continued pretraining under tensor or pipeline parallelism): each
    # weight read from the base's file and merged on its own, bitwise the whole merge
    meta = load_model_on_meta(adapter_dir)
    assert next(meta.parameters()).is_meta
    merged = dict(load_model_files(adapter_dir).named_parameters())
    values = meta.initial_values()
    assert values.keys() == merged.keys()
    for name, p in merged.items():
        assert torch.equal(values[name](), p), name
        assert torch.equal(values[name](), p), name  # read again: merged once, not twice

    # the base changed under the adapter: refused, naming it
    changed = load_model_files(base)
    with torch.no_grad():
        changed.norm.weight += 1
    from lmfoundry.model.checkpoint import save_model_files

    save_model_files(changed, base)
    checkpoint.seal(base, {"step": 0})
    with pytest.raises(ValueError, match="weights have changed since"):
        load_model_files(adapter_dir)
    with pytest.raises(ValueError, match="weights have changed since"):
        load_model_on_meta(adapter_dir)


def test_a_crafted_adapter_is_refused_on_the_meta_device_before_it_is_merged(tmp_path):
    from safetensors.torch import load_file, save_file

    base = base_checkpoint(tmp_path, "own")
    cfg = LoraConfig(rank=4, alpha=8, targets=["wq", "wo"])
    model = apply_lora(load_model_files(base), cfg)
    adapter_dir = tmp_path / "adapter"
    save_adapter_files(
        model,
        adapter_dir,
        model.state_dict(),
        AdapterRef(cfg, str(base), base_sha256(checkpoint.verify(str(base)), str(base))),
    )
    good = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    load_model_on_meta(adapter_dir)  # as written: accepted
    crafted = {
        "unexpected": {**good, "../../etc/passwd": torch.zeros(1)},
        "missing": {k: v for k, v in good.items() if k != "blocks.0.attn.wq.lora_b"},
        "has shape": {**good, "blocks.0.attn.wq.lora_a": torch.zeros(4, 7)},
        "is torch.int64": {**good, "blocks.0.attn.wq.lora_a": good["blocks.0.attn.wq.lora_a"].long()},
        "NaN or infinite": {
            **good,
            "blocks.0.attn.wq.lora_b": torch.full_like(good["blocks.0.attn.wq.lora_b"], float("nan")),
        },
    }
    for message, tensors in crafted.items():
        save_file(tensors, str(adapter_dir / ADAPTER_WEIGHTS))
        with pytest.raises(ValueError, match=message):
            load_model_on_meta(adapter_dir)
        if message in ("is torch.int64", "NaN or infinite"):  # the whole merge refuses them too
            with pytest.raises(ValueError, match=message):
                load_model_files(adapter_dir)
    save_file(good, str(adapter_dir / ADAPTER_WEIGHTS))
    config = json.loads((adapter_dir / MODEL_CONFIG).read_text())
    (adapter_dir / MODEL_CONFIG).write_text(json.dumps({**config, "norm_eps": 1e-3}))  # not its base's
    with pytest.raises(ValueError, match="is not its base"):
        load_model_on_meta(adapter_dir)


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="targets"):
        LoraConfig(targets=["wq", "wq"])
    with pytest.raises(ValueError, match="Input should be 'wq'"):
        LoraConfig(targets=["q_proj"])
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)


def test_an_adapter_reads_its_base_from_the_callers_copy_and_still_checks_it(tmp_path):
    """A training run's workers hand the loaders their node's copy of the checkpoint the run
    started from (train/sft.py report): the adapter's base is read there, not fetched from where
    the adapter names it, and the adapter's fingerprint of its base still decides."""
    base = base_checkpoint(tmp_path, "own")
    cfg = LoraConfig(rank=4, alpha=8, targets=["wq", "wo"])
    torch.manual_seed(0)
    model = apply_lora(load_model_files(base), cfg)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_b)
    named = str(tmp_path / "elsewhere" / "base")  # where the adapter says its base is: not there
    adapter_dir = tmp_path / "adapter"
    save_adapter_files(
        model, adapter_dir, model.state_dict(), AdapterRef(cfg, named, base_sha256(checkpoint.verify(str(base)), named))
    )
    with pytest.raises(FileNotFoundError):
        load_model_files(adapter_dir)
    copies = {named: str(base)}
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    with torch.no_grad():
        expected = model.eval()(x)[0]
        torch.testing.assert_close(load_model_files(adapter_dir, base_copies=copies)(x)[0], expected, atol=1e-5, rtol=0)
    meta = load_model_on_meta(adapter_dir, copies)
    merged = dict(load_model_files(adapter_dir, base_copies=copies).named_parameters())
    values = meta.initial_values()
    assert all(torch.equal(values[name](), p) for name, p in merged.items())

    from lmfoundry.model.checkpoint import save_model_files

    other = tmp_path / "other"  # a copy of another checkpoint under the base's name: refused
    shutil.copytree(base, other)
    changed = load_model_files(other)
    with torch.no_grad():
        changed.norm.weight += 1
    save_model_files(changed, other)
    checkpoint.seal(other, {"step": 0})
    wrong = {named: str(other)}
    with pytest.raises(ValueError, match="weights have changed since"):
        load_model_files(adapter_dir, base_copies=wrong)
    with pytest.raises(ValueError, match="weights have changed since"):
        load_model_on_meta(adapter_dir, wrong)
    # a directory that is not a node's verified copy is verified as it is read: weights swapped
    # under the base's own manifest are refused
    shutil.copyfile(other / WEIGHTS, base / WEIGHTS)
    for load in (
        lambda: load_model_files(adapter_dir, base_copies=copies),
        lambda: load_model_on_meta(adapter_dir, copies),
    ):
        with pytest.raises(ValueError, match="does not match its checksum"):
            load()
