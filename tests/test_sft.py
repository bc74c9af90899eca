"""Supervised fine-tuning's data path without Ray: conversations rendered with the checkpoint's
chat template, the assistant-token masks (the same as TRL's `assistant_only_loss` masks),
deterministic best-fit packing, and bad input named."""

import json

import numpy as np
import pytest
import torch
from sft_chats import write_chats

from lmfoundry.data.tokenizer import train_bpe
from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE, DEFAULT_CHAT_TEMPLATE
from lmfoundry.model.checkpoint import TOKENIZER
from lmfoundry.model.tokenizer import EOS, SPECIAL_TOKENS_FILE, SpecialTokens
from lmfoundry.train.sft_data import (
    PAD_DOC,
    ConversationEncoder,
    best_fit_decreasing,
    prepare,
    read_conversations,
)

# Llama 3's turn format with the assistant's generation marked, as TRL's training templates mark it
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}{% endfor %}"
)


def checkpoint_dir(tmp_path, template=DEFAULT_CHAT_TEMPLATE):
    """A checkpoint's tokenizer and chat template (all that the data path reads)."""
    texts = (tmp_path / "corpus.jsonl").read_text().splitlines() if (tmp_path / "corpus.jsonl").exists() else None
    texts = texts or open(write_chats(tmp_path / "corpus.jsonl", 200, seed=1)).read().splitlines()
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    train_bpe(texts + [DEFAULT_CHAT_TEMPLATE] * 20, 512).save(str(d / TOKENIZER))
    (d / CHAT_TEMPLATE_FILE).write_text(template)
    (d / SPECIAL_TOKENS_FILE).write_text(SpecialTokens(bos=EOS).to_json())  # for {{ bos_token }}
    return d


@pytest.mark.parametrize("template", ["default", "llama3_style"])
def test_assistant_masks_are_trls_assistant_only_loss_masks(tmp_path, template):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    source = DEFAULT_CHAT_TEMPLATE if template == "default" else LLAMA3_STYLE
    ckpt = checkpoint_dir(tmp_path, source)
    chats = write_chats(tmp_path / "chats.jsonl", 24)
    encoder = ConversationEncoder(str(ckpt), seq_len=10_000)
    ours = [encoder.encode(c) for _, c in read_conversations(chats)]

    tok = PreTrainedTokenizerFast(tokenizer_file=str(ckpt / TOKENIZER), eos_token=EOS, pad_token=EOS, bos_token=EOS)
    tok.chat_template = source
    rows = [json.loads(line) for line in open(chats)]
    for row in rows:  # Arrow wants one schema: tools as JSON text, which TRL parses back
        row["tools"] = json.dumps(row.get("tools"))
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        assistant_only_loss=True,
        max_length=None,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    trl = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok).train_dataset
    assert len(trl) == len(ours)
    for theirs, mine in zip(trl, ours):
        assert theirs["input_ids"] == mine.ids
        # TRL turns its assistant masks into labels: -100 wherever the loss does not look
        assert [label != -100 for label in theirs["labels"]] == mine.assistant
    assert all(any(m.assistant) and not all(m.assistant) for m in ours)


def test_packing_is_best_fit_decreasing_deterministic_and_keeps_every_conversation(tmp_path):
    assert best_fit_decreasing([5, 9, 3, 7, 2, 4], 10) == [[1], [3, 2], [0, 5], [4]]
    ckpt = checkpoint_dir(tmp_path)
    chats = write_chats(tmp_path / "chats.jsonl", 64)
    packed, report = prepare(chats, str(ckpt), 256)
    again, _ = prepare(chats, str(ckpt), 256)
    for name in ("tokens", "assistant", "docs"):
        assert getattr(packed, name).tobytes() == getattr(again, name).tobytes()
    assert report["trained"] == report["conversations"] == 64 and report["truncated"] == 0
    encoder = ConversationEncoder(str(ckpt), 256)
    lengths = sorted(len(encoder.encode(c).ids) for _, c in read_conversations(chats))
    # each conversation is one contiguous run of a document id in some row, its padding after it
    found = []
    for docs in packed.docs:
        real = docs[docs != PAD_DOC]
        assert (docs[: len(real)] != PAD_DOC).all()  # padding only at the end
        found += list(np.bincount(real))
    assert sorted(found) == lengths and report["tokens"] == sum(lengths)
    assert report["rows"] < 64 and report["fill"] > 0.8  # several conversations per row


def test_long_conversations_are_cut_and_counted_and_those_without_assistant_are_skipped(tmp_path):
    ckpt = checkpoint_dir(tmp_path)
    long_turn = {"role": "user", "content": "What is 1 + 2? " * 200}
    extra = [
        {"messages": [{"role": "user", "content": "hi"}]},  # no assistant turn
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello " * 300}]},
        {"messages": [long_turn, {"role": "assistant", "content": "3"}]},  # its answer beyond the cut
    ]
    chats = write_chats(tmp_path / "chats.jsonl", 8, extra=extra)
    packed, report = prepare(chats, str(ckpt), 256)
    assert report["conversations"] == 11 and report["trained"] == 9 and report["truncated"] == 2
    assert report["skipped"] == {"no_assistant_turn": 1, "no_assistant_tokens_after_truncation": 1}
    assert packed.tokens.shape[1] == 256


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role: Input should be 'system', 'developer'"),
        ({"messages": []}, "messages: List should have at least 1 item"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages.0.extra: Extra inputs"),
        ({"chat": []}, "messages: Field required"),
    ],
)
def test_bad_conversations_are_named_by_line_and_field(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "ok"}]}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: {message}"):
        read_conversations(str(path))


def test_a_checkpoint_without_a_template_or_generation_markers_is_refused(tmp_path):
    ckpt = checkpoint_dir(tmp_path)
    (ckpt / CHAT_TEMPLATE_FILE).write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="marks no assistant text"):
        ConversationEncoder(str(ckpt), 64)
    (ckpt / CHAT_TEMPLATE_FILE).unlink()
    with pytest.raises(ValueError, match="has no chat template"):
        ConversationEncoder(str(ckpt), 64)


def test_the_loss_counts_assistant_targets_within_their_own_conversation_only():
    from lmfoundry.train.sft import masked_mean, token_losses

    class Uniform(torch.nn.Module):
        def forward(self, idx, doc_ids):
            return torch.zeros(*idx.shape, 11), None

    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assistant = torch.tensor([[0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    _, losses, counted = token_losses(Uniform(), tokens, assistant, docs)
    # targets 2, 3 (doc 0) and 6 (doc 1); token 4 opens doc 1 and is not predicted from doc 0
    assert counted.tolist() == [[True, True, False, False, True]]
    assert masked_mean(losses, counted).item() == pytest.approx(float(np.log(11)))


def test_token_distillation_kl_on_a_hand_computed_example():
    """Teacher (1/4, 3/4), student (1/2, 1/2): KL = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.130812 at T = 1. At
    T = 2 the teacher's logits halve: (1, sqrt 3) / (1 + sqrt 3) = (0.366025, 0.633975), so
    KL = 0.366025 ln(0.732051) + 0.633975 ln(1.267949) = 0.036341; a uniform student stays uniform."""
    from lmfoundry.train.sft import distill_kl

    teacher = torch.tensor([[0.0, float(np.log(3))]])
    student = torch.tensor([[0.0, 0.0]])
    assert distill_kl(teacher, student, 1.0).item() == pytest.approx(0.130812, abs=1e-6)
    assert distill_kl(teacher, student, 2.0).item() == pytest.approx(0.036341, abs=1e-6)
    assert distill_kl(teacher, teacher, 1.0).item() == pytest.approx(0.0, abs=1e-7)


def test_token_distillation_loss_weighs_ce_against_t2_kl_on_the_assistant_tokens_with_a_frozen_teacher():
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.train.sft import TokenDistillConfig, distill_kl, distill_loss, masked_mean, token_losses

    torch.manual_seed(0)
    shape = {"vocab_size": 13, "max_seq_len": 16, "n_layer": 1, "d_model": 16, "n_head": 2, "n_kv_head": 1}
    student, teacher = Transformer(ModelConfig(**shape)), Transformer(ModelConfig(**shape)).requires_grad_(False)
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    assistant = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    logits, losses, counted = token_losses(student, tokens, assistant, docs)
    ce = masked_mean(losses, counted)
    cfg = TokenDistillConfig(teacher="unused", temperature=2.0, weight=0.25)
    loss, metrics = distill_loss(teacher, cfg, (tokens, assistant, docs), logits, ce, counted, "cpu", {})
    # the same by hand: the KL at each counted position, averaged, then the weighted sum
    with torch.no_grad():
        t_logits, _ = teacher(tokens[:, :-1], doc_ids=docs[:, :-1])
    positions = counted[0].nonzero().flatten().tolist()
    # assistant targets 3, 4, 6 and 7; token 5 opens the second conversation, not predicted from the first
    assert positions == [1, 2, 4, 5]
    kl = sum(distill_kl(t_logits[0, p], logits[0, p], 2.0) for p in positions).item() / len(positions)
    assert metrics["kl"] == pytest.approx(kl, rel=1e-5) and metrics["ce"] == pytest.approx(ce.item())
    assert loss.item() == pytest.approx(0.75 * ce.item() + 0.25 * 4 * kl, rel=1e-5)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="weight"):
        TokenDistillConfig(teacher="t", weight=1.5)


def test_a_teacher_with_another_vocabulary_is_a_config_error_naming_both(tmp_path):
    from lmfoundry.train.sft import check_same_vocabulary

    dirs = {}
    for name, texts in (("student", ["alpha beta gamma"] * 50), ("teacher", ["delta epsilon zeta"] * 50)):
        d = tmp_path / name
        d.mkdir()
        tok = train_bpe(texts, 300)
        tok.save(str(d / TOKENIZER))
        (d / "model_config.json").write_text(json.dumps({"vocab_size": tok.get_vocab_size()}))
        dirs[name] = str(d)
    check_same_vocabulary(dirs["student"], dirs["student"], "work/student", "work/student")
    with pytest.raises(ValueError, match=r"teacher work/teacher .* student work/student .* do not share a vocabulary"):
        check_same_vocabulary(dirs["student"], dirs["teacher"], "work/student", "work/teacher")


def test_the_sft_objective_runs_the_teacher_beside_the_student(tmp_path):
    """The objective as a worker builds it (no Ray): the teacher loaded from its checkpoint, frozen,
    and the micro-batch's loss carrying both terms."""
    from lmfoundry.model.checkpoint import save_model_files
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.train.sft import SFTConfig, SFTObjective

    ckpt = checkpoint_dir(tmp_path)
    vocab = len(json.loads((ckpt / TOKENIZER).read_text())["model"]["vocab"])
    shape = {"vocab_size": vocab, "max_seq_len": 128, "n_layer": 1, "d_model": 16, "n_head": 2, "n_kv_head": 1}
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    torch.manual_seed(1)
    save_model_files(Transformer(ModelConfig(**shape)), teacher)
    torch.manual_seed(0)
    save_model_files(Transformer(ModelConfig(**shape)), ckpt)
    chats = write_chats(tmp_path / "chats.jsonl", 8)
    cfg = SFTConfig(
        checkpoint=str(ckpt),
        data=chats,
        output=str(tmp_path / "out"),
        batch={"micro_batch_size": 2, "global_batch_sequences": 2},
        parallelism={"num_workers": 1},
        distill={"teacher": str(teacher), "temperature": 2.0, "weight": 0.5},
    )
    objective = SFTObjective(cfg, str(ckpt), 0, 1, teacher_dir=str(teacher))
    objective.device = torch.device("cpu")
    _, batch = next(objective.batches(0, 0))
    loss, metrics = objective.loss(objective.model, batch)
    assert metrics["kl"] > 0 and loss.item() == pytest.approx(0.5 * metrics["ce"] + 0.5 * 4 * metrics["kl"], rel=1e-5)
    assert not any(p.requires_grad for p in objective.teacher.parameters())


def test_the_before_and_after_loss_reads_a_bounded_sample_spread_over_the_whole_data():
    from lmfoundry.train.sft import ASSISTANT_LOSS_ROWS, sample_rows

    assert sample_rows(0).tolist() == [] and sample_rows(3).tolist() == [0, 1, 2]
    rows = sample_rows(10_000)
    assert len(rows) == ASSISTANT_LOSS_ROWS and rows[0] == 0 and rows[-1] == 9_999
    gaps = np.diff(rows)
    assert gaps.min() >= 39 and gaps.max() <= 40  # evenly spread, not the first rows


def test_freeze_keeps_the_named_parameters_and_refuses_what_matches_nothing_or_everything(tmp_path):
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.train.sft import SFTConfig, freeze

    model = Transformer(ModelConfig(vocab_size=64, max_seq_len=16, n_layer=2, d_model=16, n_head=2, n_kv_head=1))
    freeze(model, ["blocks.*.attn.*", "embed.weight"])
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == {
        "embed.weight",
        *(f"blocks.{i}.attn.{w}.weight" for i in (0, 1) for w in ("wq", "wkv", "wo")),
    }
    with pytest.raises(ValueError, match=r"'blocks\.\*\.attention\.\*' matches no parameter; the model's are embed"):
        freeze(Transformer(model.cfg), ["blocks.*.attention.*"])
    with pytest.raises(ValueError, match="a tied head is embed.weight; untie_embeddings"):
        freeze(Transformer(model.cfg), ["lm_head.weight"])
    with pytest.raises(ValueError, match="freezes every parameter"):
        freeze(Transformer(model.cfg), ["*"])
    with pytest.raises(ValueError, match="give freeze or lora, not both"):
        SFTConfig(checkpoint="c", data="d.jsonl", output=str(tmp_path), freeze=["blocks.*"], lora={"rank": 4})


def test_untie_embeddings_gives_the_head_its_own_weight_that_a_freeze_keeps(tmp_path):
    from lmfoundry.model.checkpoint import load_model_files, save_model_files
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.train.sft import SFTConfig, freeze

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, max_seq_len=16, n_layer=2, d_model=16, n_head=2, n_kv_head=1))
    start = model.embed.weight.detach().clone()
    model.untie_head()
    assert not model.cfg.tie_embeddings and model.lm_head.weight is not model.embed.weight
    assert torch.equal(model.lm_head.weight, start)
    freeze(model, ["lm_head.weight"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(64, (2, 9))
    logits = model(tokens[:, :-1])
    logits = logits[0] if isinstance(logits, tuple) else logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    assert torch.equal(model.lm_head.weight, start)  # the output rows stay; the input rows train
    assert not torch.equal(model.embed.weight, start)
    save_model_files(model, tmp_path)
    again = load_model_files(tmp_path)  # saved and read back untied, both tables
    assert torch.equal(again.lm_head.weight, start) and torch.equal(again.embed.weight, model.embed.weight)
    with pytest.raises(ValueError, match="untied already"):
        again.untie_head()
    from lmfoundry.train.sft import check_model_settings

    with pytest.raises(ValueError, match="untied already"):  # in the driver, before any worker starts
        check_model_settings(
            SFTConfig(checkpoint="c", data="d.jsonl", output=str(tmp_path / "u"), untie_embeddings=True),
            again.cfg.model_dump(),
        )
    with pytest.raises(ValueError, match="a tied head is embed.weight"):
        check_model_settings(
            SFTConfig(checkpoint="c", data="d.jsonl", output=str(tmp_path / "u"), freeze=["lm_head.*"]),
            model.cfg.model_copy(update={"tie_embeddings": True}).model_dump(),
        )
    with pytest.raises(ValueError, match="untie_embeddings: a LoRA run"):
        SFTConfig(checkpoint="c", data="d.jsonl", output=str(tmp_path / "o"), untie_embeddings=True, lora={"rank": 4})


@pytest.mark.parametrize("bad", [[""], ["x" * 257], ["blocks.*"] * 65, "blocks.*", [3]])
def test_freeze_that_is_not_a_short_list_of_patterns_is_refused(tmp_path, bad):
    from lmfoundry.train.sft import SFTConfig

    with pytest.raises(ValueError, match="freeze"):
        SFTConfig(checkpoint="c", data="d.jsonl", output=str(tmp_path / "o"), freeze=bad)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("wrapped", ["lora", "untied head, frozen"])
def test_a_zero3_start_on_the_meta_device_reads_each_parameter_from_the_checkpoint_by_its_new_name(tmp_path, wrapped):
    # under ZeRO-3 the SFT model is built on the meta device and each parameter read from the
    # checkpoint when the engine partitions it: an adapted projection's base weight and an
    # untied head find the checkpoint's tensors they start from; the adapters are not read
    from lmfoundry.model.checkpoint import load_model_files, load_model_on_meta, save_model_files
    from lmfoundry.model.lora import LoraConfig, apply_lora
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.train.sft import freeze, values_after_wrapping

    cfg = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=2, d_model=16, n_head=2, n_kv_head=1, attention_bias=True)
    save_model_files(Transformer(cfg), tmp_path)
    whole = load_model_files(tmp_path)
    model = load_model_on_meta(tmp_path)
    loaded = model.initial_values()
    if wrapped == "lora":
        apply_lora(model, LoraConfig(rank=2, targets=["wq", "wo"]))
        apply_lora(whole, LoraConfig(rank=2, targets=["wq", "wo"]))
    else:
        model.untie_head()
        whole.untie_head()
        freeze(model, ["lm_head.weight"])
    values = values_after_wrapping(model, loaded)
    meta = {name for name, p in model.named_parameters() if p.is_meta}
    assert set(values) == meta and meta
    expected = dict(whole.named_parameters())
    for name in meta:
        assert torch.equal(values[name](), expected[name]), name
    if wrapped == "lora":
        assert "blocks.0.attn.wq.base.bias" in values and not any("lora_" in name for name in values)
    else:
        assert torch.equal(values["lm_head.weight"](), expected["embed.weight"])
