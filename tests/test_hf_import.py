"""Hugging Face checkpoints of every supported family, built tiny and random by `transformers`
itself, import to lmfoundry checkpoints whose logits and greedy generations are transformers'."""

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lmfoundry.jobs.import_model import main as import_main
from lmfoundry.model.chat_template import ChatTemplate
from lmfoundry.model.checkpoint import TOKENIZER, load_model_files
from lmfoundry.model.generate import generate
from lmfoundry.model.tokenizer import SpecialTokens
from lmfoundry.platform import checkpoint

VOCAB = 320
SPECIALS = ["<s>", "</s>", "<pad>", "<|start|>", "<|eot|>"]
# a template of the Llama 3 kind: the bos token written by the template, turns ended by <|eot|>
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
    "<|start|>{{ m.role }}\n{{ m.content }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
TEXT = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.", "Ünïcödé ✓"] * 20
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
SMALL |= dict(num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1)


def families():
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    # (name, config, how it is saved)
    return [
        ("llama3-sharded", LlamaConfig(**SMALL, rope_parameters=llama3_rope, tie_word_embeddings=False), "sharded"),
        ("llama2-tied-bf16", LlamaConfig(**SMALL, tie_word_embeddings=True), "bf16"),
        ("qwen2-bias", Qwen2Config(**SMALL, tie_word_embeddings=True), ""),
        ("qwen3-qknorm", Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=False), ""),
        ("mistral", MistralConfig(**SMALL, sliding_window=None, tie_word_embeddings=False), ""),
        ("mixtral", MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=None), ""),
        (
            "qwen3-moe",
            Qwen3MoeConfig(
                **SMALL,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                mlp_only_layers=[0],
                norm_topk_prob=False,
            ),
            "",
        ),
    ]


def write_tokenizer(directory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 20, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "chat_template": TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    # an instruct model: generation also ends at the end of a turn
    gen = {"bos_token_id": 0, "eos_token_id": [1, tok.token_to_id("<|eot|>")]}
    (directory / "generation_config.json").write_text(json.dumps(gen))
    return tok


def build_hf(directory, config, how):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if how == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="40KB" if how == "sharded" else "5GB")
    write_tokenizer(directory)
    return directory


@pytest.mark.parametrize("family", [f[0] for f in families()])
def test_import_matches_transformers_logits_and_greedy_generation(tmp_path, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, config, how = next(f for f in families() if f[0] == family)
    src = build_hf(tmp_path / "hf", config, how)
    if how == "sharded":
        assert (src / "model.safetensors.index.json").exists()
    assert import_main(["hf", str(src), str(tmp_path / "ours")]) == 0

    with checkpoint.opened(str(tmp_path / "ours")) as (local, manifest):
        ours = load_model_files(local)
    assert manifest["imported_from"]["model_type"] == config.model_type
    theirs = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], theirs(x).logits, atol=1e-4, rtol=1e-4)

    prompt = x[0, :12].tolist()
    mine = generate(ours, prompt, max_new_tokens=8, temperature=0.0).tokens
    theirs.generation_config.eos_token_id = None  # both run the full 8 tokens
    ref = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=2)
    assert mine == ref[0, len(prompt) :].tolist()

    # the tokenizer, chat template and special tokens travel with the model
    tok = Tokenizer.from_file(str(tmp_path / "ours" / TOKENIZER))
    special = SpecialTokens.of_checkpoint(tmp_path / "ours")
    assert (special.bos, special.eos, special.pad) == ("<s>", "</s>", "<pad>")
    assert special.stop_ids(tok) == {1, tok.token_to_id("<|eot|>")}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    hf_tok = AutoTokenizer.from_pretrained(src)
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.from_checkpoint(tmp_path / "ours").render(messages) == expected
    assert expected.startswith("<s><|start|>user\nHi<|eot|>")


@pytest.fixture(scope="module")
def plain_src(tmp_path_factory):
    from transformers import MistralConfig

    return build_hf(tmp_path_factory.mktemp("plain") / "hf", MistralConfig(**SMALL, sliding_window=None), "")


REFUSED = [
    ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, "model_type"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial"),
    ({"sliding_window": 64}, "sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),  # None: the field is left out
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    # crafted values: each named before any arithmetic or allocation is sized by it
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"hidden_size": "64"}, "hidden_size='64'"),
    ({"sliding_window": "4096"}, "sliding_window='4096'"),
    ({"max_position_embeddings": 2 * 10**9}, "max_position_embeddings=2000000000"),
    ({"num_key_value_heads": -2}, "num_key_value_heads=-2"),
]


def test_what_the_model_does_not_compute_is_refused_naming_the_field(plain_src, tmp_path, capsys):
    config = json.loads((plain_src / "config.json").read_text())
    for i, (change, field) in enumerate(REFUSED):
        src = tmp_path / f"case{i}"
        shutil.copytree(plain_src, src)
        changed = {k: v for k, v in (config | change).items() if v is not None}
        (src / "config.json").write_text(json.dumps(changed))
        assert import_main(["hf", str(src), str(tmp_path / "ours")]) == 2, change
        assert field in capsys.readouterr().err, change
        assert not (tmp_path / "ours").exists()


def test_a_window_narrower_than_the_context_imports_with_the_context_cut_to_it(plain_src, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(plain_src, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"sliding_window": 64}))
    assert import_main(["hf", str(src), str(tmp_path / "ours"), "--max-seq-len", "64"]) == 0
    assert load_model_files(tmp_path / "ours").cfg.max_seq_len == 64
    assert import_main(["hf", str(src), str(tmp_path / "ours")]) == 2  # a complete checkpoint stays


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.json", "config.json", "generation_config.json"])
def test_a_source_file_that_is_a_link_is_refused_not_followed(plain_src, tmp_path, capsys, name):
    """A link could reach any file the process can read (a template from ~/.netrc would be
    rendered into every served prompt): refused, as a linked weights shard is."""
    src = tmp_path / "hf"
    shutil.copytree(plain_src, src)
    secret = tmp_path / "netrc"
    secret.write_text("machine api.example.com login ci password s3cr3t")
    if name == "chat_template.jinja":  # read when tokenizer_config.json holds no template
        config = json.loads((src / "tokenizer_config.json").read_text())
        (src / "tokenizer_config.json").write_text(
            json.dumps({k: v for k, v in config.items() if k != "chat_template"})
        )
    (src / name).unlink(missing_ok=True)
    (src / name).symlink_to(secret)
    assert import_main(["hf", str(src), str(tmp_path / "ours")]) == 2
    assert f"{name} is a symbolic link" in capsys.readouterr().err
    assert not (tmp_path / "ours").exists()


def test_a_malformed_generation_config_or_shard_index_is_a_clear_error(plain_src, tmp_path, capsys):
    src = tmp_path / "hf"
    shutil.copytree(plain_src, src)
    (src / "generation_config.json").write_text("[]")
    assert import_main(["hf", str(src), str(tmp_path / "ours")]) == 2
    assert "generation_config.json is not a JSON object" in capsys.readouterr().err
    (src / "generation_config.json").unlink()
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": ["model.safetensors"]}}))
    assert import_main(["hf", str(src), str(tmp_path / "ours")]) == 2
    assert "weight_map" in capsys.readouterr().err


@pytest.mark.parametrize(
    "remove, what",
    [("tokenizer.json", "tokenizer.json"), ("chat_template", "chat template"), ("config.json", "config.json")],
)
def test_missing_tokenizer_template_or_config_is_a_clear_error(plain_src, tmp_path, capsys, remove, what):
    src = tmp_path / "hf"
    shutil.copytree(plain_src, src)
    if remove == "chat_template":
        config = json.loads((src / "tokenizer_config.json").read_text())
        (src / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != remove}))
    else:
        (src / remove).unlink()
    assert import_main(["hf", str(src), str(tmp_path / "ours")]) == 2
    assert what in capsys.readouterr().err


def test_an_imported_checkpoint_serves_evaluates_and_exports_as_its_family(tmp_path):
    import asyncio

    import numpy as np
    import pyarrow as pa
    from transformers import AutoModelForCausalLM, Qwen2Config

    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.eval.perplexity import SequenceNLL
    from lmfoundry.jobs.export import main as export_main
    from lmfoundry.serving.engine import InferenceEngine

    src = build_hf(tmp_path / "hf", Qwen2Config(**SMALL, tie_word_embeddings=True), "")
    assert import_main(["hf", str(src), str(tmp_path / "ours")]) == 0
    ours = str(tmp_path / "ours")
    eot = Tokenizer.from_file(str(src / "tokenizer.json")).token_to_id("<|eot|>")

    # serving: the imported template renders the prompt, its eos and end of turn stop a generation
    engine = InferenceEngine(ours, "cpu", max_batch_size=2)
    try:
        assert engine.stop_ids == {1, eot}
        prompt = engine.chat_template.render([{"role": "user", "content": "Hi"}])
        ids = engine.encode(prompt)
        assert ids[:2] == [0, engine.tokenizer.token_to_id("<|start|>")]  # <s> once, from the template
        reply = asyncio.run(_complete(engine, ids, 4))
        assert 1 <= reply.completion_tokens <= 4
    finally:
        engine.batcher.close()
    # evaluation: chat through the checkpoint client, bits per byte over the imported tokenizer
    client = CheckpointModel(ours, device="cpu")
    assert client.stop_tokens == {1, eot} and isinstance(client.chat([[{"role": "user", "content": "Hi"}]], 4)[0], str)
    tokens = np.array([client.encode("def add(a, b):\n    return a + b\n")[:9]], dtype=np.int64)
    nll = SequenceNLL(ours)(pa.table({"tokens": pa.array(list(tokens))}))
    assert nll.column("bytes")[0].as_py() > 0 and np.isfinite(nll.column("nll")[0].as_py())

    # export: back to the family it came from, with the same logits
    assert export_main([ours, str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "Qwen2ForCausalLM"
    x = torch.randint(0, VOCAB, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, load_model_files(ours)(x)[0], atol=1e-4, rtol=1e-4)
    assert json.loads((tmp_path / "back" / "generation_config.json").read_text())["eos_token_id"] == [1, eot]


async def _complete(engine, ids, n):
    from lmfoundry.serving.sampling import SamplingParams

    return await engine.stream(ids, SamplingParams(n, 0.0)).collect()


def test_pack_tokenizes_with_an_imported_checkpoints_tokenizer_and_eos(tmp_path):
    import pyarrow as pa
    from transformers import LlamaConfig

    from lmfoundry.data.pack import ORDER, PackConfig, Tokenize, checkpoint_tokenizer

    src = build_hf(tmp_path / "hf", LlamaConfig(**SMALL), "")
    assert import_main(["hf", str(src), str(tmp_path / "ours")]) == 0
    text, eos, vocab = checkpoint_tokenizer(str(tmp_path / "ours"))
    # the model's vocabulary (larger than the tokenizer's) and the imported end of sequence </s>
    assert (text, eos, vocab) == ((tmp_path / "ours" / TOKENIZER).read_text(), 1, VOCAB)
    cfg = PackConfig(input="unused", output="unused", tokenizer=str(tmp_path / "ours"))
    batch = pa.table({ORDER: [1, 2], "id": ["a", "b"], "text": ["def add(a, b):", "The quick brown fox"]})
    ids = Tokenize(text, eos, cfg)(batch).column("ids").to_pylist()
    tok = Tokenizer.from_str(text)
    assert [r[-1] for r in ids] == [1, 1] and tok.decode(ids[1][:-1]) == "The quick brown fox"
    (tmp_path / "ours" / TOKENIZER).write_text(text + " ")  # changed after the checkpoint was sealed
    with pytest.raises(ValueError, match="checksum"):
        checkpoint_tokenizer(str(tmp_path / "ours"))
    with pytest.raises(FileNotFoundError, match="is neither a checkpoint"):
        checkpoint_tokenizer(str(tmp_path / "nothing"))


def test_a_checkpoints_tokenizer_over_its_size_limit_is_refused_unread(tmp_path, monkeypatch):
    # a crafted checkpoint (a manifest that vouches for a huge tokenizer.json or config, or a file
    # larger than its manifest says) is refused without reading more than the limit
    from transformers import LlamaConfig

    from lmfoundry.model import tokenizer
    from lmfoundry.platform import storage

    src = build_hf(tmp_path / "hf", LlamaConfig(**SMALL), "")
    assert import_main(["hf", str(src), str(tmp_path / "ours")]) == 0
    original = (tmp_path / "ours" / TOKENIZER).read_bytes()
    size = len(original)
    reads = []
    monkeypatch.setattr(
        storage, "read_bytes", lambda path, limit=None, read=storage.read_bytes: reads.append(path) or read(path, limit)
    )
    monkeypatch.setattr(tokenizer, "MAX_TOKENIZER_BYTES", size - 1)
    with pytest.raises(ValueError, match=f"tokenizer.json is {size:,} bytes; at most"):
        tokenizer.checkpoint_tokenizer(str(tmp_path / "ours"))
    assert not any(path.endswith(TOKENIZER) for path in reads)
    monkeypatch.setattr(tokenizer, "MAX_TOKENIZER_BYTES", size)
    with open(tmp_path / "ours" / TOKENIZER, "ab") as f:  # grown past what the manifest vouched for
        f.write(b" " * 10_000)
    with pytest.raises(ValueError, match=f"tokenizer.json: .* holds more than {size:,} bytes"):
        tokenizer.checkpoint_tokenizer(str(tmp_path / "ours"))
    (tmp_path / "ours" / TOKENIZER).write_bytes(original)
    monkeypatch.setattr(tokenizer, "MAX_TEXT_FILE_BYTES", 10)
    with pytest.raises(ValueError, match="bytes; at most 10 allowed"):
        tokenizer.checkpoint_tokenizer(str(tmp_path / "ours"))
    # a manifest itself is read only up to its limit
    monkeypatch.setattr(storage, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(ValueError, match="holds more than 100 bytes"):
        tokenizer.checkpoint_tokenizer(str(tmp_path / "ours"))


def test_the_import_commands_help_names_every_family_the_importer_takes():
    from lmfoundry.jobs import import_model
    from lmfoundry.model import hf_import

    assert import_model.FAMILIES == ", ".join(hf_import.FAMILIES)  # kept apart so that --help imports no torch


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_sample_checkpoint_of_each_family_imports_and_answers_a_chat(tmp_path, family):
    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.data.sample_checkpoint import build_sample_checkpoint

    src = build_sample_checkpoint(tmp_path / "hf", family)
    assert json.loads((src / "config.json").read_text())["model_type"] == family
    assert import_main(["hf", str(src), str(tmp_path / "ours")]) == 0
    client = CheckpointModel(str(tmp_path / "ours"), device="cpu")
    assert isinstance(client.chat([[{"role": "user", "content": "What is 3 + 4?"}]], 4)[0], str)


def test_the_sample_checkpoint_never_writes_into_a_directory_that_holds_files(tmp_path, capsys):
    from lmfoundry.data.sample_checkpoint import main

    real = tmp_path / "Qwen3-8B"
    real.mkdir()
    (real / "model-00001-of-00002.safetensors").write_bytes(b"weights")
    assert main([str(real)]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in real.iterdir()] == ["model-00001-of-00002.safetensors"]
    (tmp_path / "file").write_text("x")
    assert main([str(tmp_path / "file")]) == 2
    for bad in (["--seed", "-1"], ["--seed", str(2**32)], ["--seed", "x"], ["--family", "deepseek_v3"]):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path / "new"), *bad])
        assert e.value.code == 2 and not (tmp_path / "new").exists(), bad
