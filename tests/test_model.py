import pytest
import torch

from lmfoundry.model.checkpoint import load_model_files, save_model_files
from lmfoundry.model.generate import generate
from lmfoundry.model.transformer import KVCache, ModelConfig, Transformer


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=97, max_seq_len=48, n_layer=2, d_model=32, n_head=4, n_kv_head=2, **kw))


def test_forward_shapes_and_initial_loss_near_uniform():
    m = tiny()
    x, y = torch.randint(0, 97, (3, 20)), torch.randint(0, 97, (3, 20))
    logits, loss = m(x, y)
    assert logits.shape == (3, 20, 97)
    assert abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.5


def test_kv_cache_matches_full_forward():
    m = tiny().eval()
    x = torch.randint(0, 97, (2, 30))
    full, _ = m(x)
    cache = KVCache(m.cfg, 2, 30, "cpu", torch.float32)
    parts = [m(x[:, :17], cache=cache)[0], m(x[:, 17:25], cache=cache)[0]]
    parts += [m(x[:, t : t + 1], cache=cache)[0] for t in range(25, 30)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-4)


def test_logits_at_gives_the_full_forwards_logits_at_those_positions_only():
    m = tiny().eval()
    x = torch.randint(0, 97, (3, 20))
    at = torch.tensor([19, 4, 11])  # each row's last prompt token, as a right-padded prefill has them
    with torch.no_grad():
        full, _ = m(x)
        picked, _ = m(x, logits_at=at)
        cached, _ = m(x, cache=KVCache(m.cfg, 3, 48, "cpu", torch.float32), logits_at=at)
    assert picked.shape == cached.shape == (3, 1, 97)
    torch.testing.assert_close(picked[:, 0], full[torch.arange(3), at], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cached, picked, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="logits_at and targets"):
        m(x, x, logits_at=at)


def test_cache_slots_at_different_lengths_decode_in_one_pass():
    """Continuous batching: three sequences prefilled one by one into slots 2, 0 and 3 of a
    four-slot cache, then decoded together, give each sequence's own full-forward logits."""
    m = tiny().eval()
    seqs = [torch.randint(0, 97, (1, n)) for n in (5, 11, 8)]
    slots = torch.tensor([2, 0, 3])
    cache = KVCache(m.cfg, 4, 48, "cpu", torch.float32)
    with torch.no_grad():
        for seq, slot in zip(seqs, slots):
            m(seq[:, :-1], cache=cache, slots=slot[None])
        last = torch.cat([seq[:, -1:] for seq in seqs])  # (3, 1): each sequence's next token
        batched = m(last, cache=cache, slots=slots)[0][:, 0]
        for row, seq in enumerate(seqs):
            torch.testing.assert_close(batched[row], m(seq)[0][0, -1], atol=1e-5, rtol=1e-4)
        assert cache.lengths.tolist() == [11, 0, 5, 8]
        cache.reset([0])  # slot 0 freed and reused by a new sequence
        fresh = torch.randint(0, 97, (1, 6))
        torch.testing.assert_close(m(fresh, cache=cache, slots=torch.tensor([0]))[0], m(fresh)[0], atol=1e-5, rtol=1e-4)


def test_model_is_causal():
    m = tiny().eval()
    x = torch.randint(0, 97, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 97
    torch.testing.assert_close(m(x)[0][:, :10], m(y)[0][:, :10])


def test_training_overfits_a_batch():
    m = tiny()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    x = torch.randint(0, 97, (4, 33))
    first = None
    for _ in range(60):
        _, loss = m(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first or loss.item()
    assert loss.item() < 0.3 * first


def test_generate_is_seeded_greedy_is_deterministic_and_respects_context():
    m = tiny().eval()
    a = generate(m, [1, 2, 3], 10, temperature=0.9, top_p=0.9, seed=7)
    b = generate(m, [1, 2, 3], 10, temperature=0.9, top_p=0.9, seed=7)
    assert a.tokens == b.tokens and len(a.tokens) == 10 and a.finish_reason == "length"
    g = generate(m, [1, 2, 3], 100, temperature=0)
    assert len(g.tokens) == 48 - 3  # clipped to the context
    first = g.tokens[0]
    assert generate(m, [1, 2, 3], 5, temperature=0, stop_tokens=frozenset({first})).tokens == []


def test_checkpoint_roundtrip_with_tied_weights(tmp_path):
    m = tiny().eval()
    save_model_files(m, tmp_path)
    loaded = load_model_files(tmp_path)
    x = torch.randint(0, 97, (1, 12))
    torch.testing.assert_close(loaded(x)[0], m(x)[0])
    assert loaded.lm_head.weight.data_ptr() == loaded.embed.weight.data_ptr()


def test_untied_checkpoint_roundtrip(tmp_path):
    m = tiny(tie_embeddings=False).eval()
    save_model_files(m, tmp_path)
    x = torch.randint(0, 97, (1, 12))
    torch.testing.assert_close(load_model_files(tmp_path)(x)[0], m(x)[0])


def naive_attention(attn, x: torch.Tensor) -> torch.Tensor:
    """The textbook computation, written independently: rotary embedding as complex rotation of
    (first half, second half) pairs, every query head with its own copy of its group's key/value
    head, an explicit causal mask and softmax."""
    cfg = attn.cfg
    B, T, _ = x.shape
    H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    q = (x @ attn.wq.weight.T).view(B, T, H, D)
    kv = (x @ attn.wkv.weight.T).view(B, T, 2, K, D)
    k, v = kv[:, :, 0], kv[:, :, 1]
    freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2).float() / D)
    rot = torch.polar(torch.ones(T, D // 2), torch.outer(torch.arange(T).float(), freqs))  # (T, D/2)

    def rope(t):
        c = torch.complex(t[..., : D // 2], t[..., D // 2 :]) * rot[None, :, None, :]
        return torch.cat([c.real, c.imag], dim=-1)

    q, k = rope(q), rope(k)
    out = torch.empty(B, T, H, D)
    for h in range(H):
        g = h // (H // K)  # the key/value head this query head shares
        scores = q[:, :, h] @ k[:, :, g].transpose(1, 2) / D**0.5  # (B, T, T)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out[:, :, h] = scores.softmax(-1) @ v[:, :, g]
    return out.reshape(B, T, H * D) @ attn.wo.weight.T


def test_rope_and_gqa_attention_match_a_naive_implementation():
    torch.manual_seed(0)
    for n_kv_head in (1, 2, 4):  # multi-query, grouped, multi-head
        m = Transformer(
            ModelConfig(
                vocab_size=50, max_seq_len=24, n_layer=1, d_model=32, n_head=4, n_kv_head=n_kv_head, rope_theta=500.0
            )
        ).eval()
        attn = m.blocks[0].attn
        x = torch.randn(2, 24, 32)
        got = attn(x, m.rope_cos[None, :24], m.rope_sin[None, :24])
        torch.testing.assert_close(got, naive_attention(attn, x), atol=1e-5, rtol=1e-4)


def test_rope_makes_attention_depend_on_relative_position_only():
    torch.manual_seed(0)
    from lmfoundry.model.transformer import apply_rope, rope_tables

    cos, sin = rope_tables(16, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j):
        return (
            apply_rope(q, cos[None, i : i + 1], sin[None, i : i + 1])
            * apply_rope(k, cos[None, j : j + 1], sin[None, j : j + 1])
        ).sum()

    torch.testing.assert_close(score(5, 2), score(40, 37))
    assert not torch.allclose(score(5, 2), score(5, 3))


def test_nucleus_sampling_keeps_the_top_token_at_any_top_p():
    from lmfoundry.model.generate import sample_next

    logits = torch.tensor([0.1, 3.0, -1.0, 2.0])
    for top_p in (5e-324, 1e-45, 1e-9, 0.3):
        assert sample_next(logits, 1.0, top_p, torch.Generator().manual_seed(0)) == 1


def test_decode_attention_equals_sdpa_with_shared_key_value_heads_and_a_mask():
    import torch.nn.functional as F

    from lmfoundry.serving.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(0)
    for B, H, K, D, L in [(16, 6, 2, 64, 128), (3, 4, 4, 16, 7), (5, 8, 2, 32, 33)]:
        q = torch.randn(B, H, 1, D, generator=gen)
        k, v = torch.randn(B, K, L, D, generator=gen), torch.randn(B, K, L, D, generator=gen)
        filled = torch.randint(1, L + 1, (B,), generator=gen)
        mask = torch.arange(L)[None, None, None, :] < filled[:, None, None, None]
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=K != H)
        assert torch.allclose(decode_attention(q, k, v, mask), ref, atol=1e-5)


@pytest.mark.parametrize("decode_kernel", [True, False, None])  # None: the faster one, timed here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cached_decode_step_past_the_decode_attention_threshold_matches_the_full_forward(decode_kernel, dtype):
    from lmfoundry.model.transformer import KVCache, ModelConfig, Transformer
    from lmfoundry.serving.decode_attention import DECODE_ATTENTION_MIN_WORK, engine_attention

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, max_seq_len=160, n_layer=1, d_model=32, n_head=4, n_kv_head=2)
    model = Transformer(cfg).eval().to(dtype)
    idx = torch.randint(0, 64, (16, 130))
    assert 16 * 130 >= DECODE_ATTENTION_MIN_WORK  # the decode step below may take decode_attention
    attention = engine_attention(cfg.n_head, cfg.n_kv_head, cfg.head_dim, dtype, "cpu", decode_kernel)
    with torch.inference_mode():
        full = model(idx)[0][:, -1].float()
        cache = KVCache(model.cfg, 16, 160, "cpu", dtype, attention)
        model(idx[:, :-1], cache=cache)
        step = model(idx[:, -1:], cache=cache)[0][:, -1].float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.05  # bfloat16 keeps 8 bits
    torch.testing.assert_close(step, full, atol=tolerance, rtol=tolerance)


def test_the_engine_times_the_decode_kernel_only_on_cpu():
    from lmfoundry.model import transformer
    from lmfoundry.serving.decode_attention import engine_attention

    assert engine_attention(4, 2, 8, torch.float32, "meta") is transformer.cached_attention  # not timed
    assert engine_attention(4, 2, 8, torch.float32, "cpu", decode_kernel=False) is transformer.cached_attention
    assert engine_attention(4, 2, 8, torch.float32, "cpu", decode_kernel=True) is not transformer.cached_attention


def test_a_packed_row_gives_each_document_the_logits_it_gets_alone():
    """Document ids close attention across documents and restart positions at each one."""
    m = tiny().eval()
    docs = [torch.randint(0, 97, (1, n)) for n in (7, 13, 5)]
    row = torch.cat(docs, dim=1)
    ids = torch.cat([torch.full((1, d.shape[1]), i) for i, d in enumerate(docs)], dim=1)
    with torch.no_grad():
        packed, _ = m(row, doc_ids=ids)
        alone = torch.cat([m(d)[0] for d in docs], dim=1)
        plain, _ = m(row)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    assert not torch.allclose(plain[:, 7:], alone[:, 7:], atol=1e-3)  # without them, documents see each other


def test_initial_values_depend_on_the_seed_and_the_name_only():
    from lmfoundry.model.moe import MoEConfig
    from lmfoundry.model.transformer import build_on_meta

    cfg = ModelConfig(
        vocab_size=64, max_seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2, attention_bias=True, qk_norm=True
    )
    torch.manual_seed(7)
    whole = Transformer(cfg)
    torch.manual_seed(7)
    state = torch.get_rng_state()
    meta = build_on_meta(cfg)
    assert torch.equal(torch.get_rng_state(), state)  # a meta build leaves torch's generator alone
    assert meta.init_seed == whole.init_seed and next(meta.parameters()).is_meta
    values = meta.initial_values()
    params = dict(whole.named_parameters())
    assert values.keys() == params.keys()
    for name, p in params.items():
        assert torch.equal(values[name](), p), name
    std = cfg.init_std
    assert torch.equal(params["blocks.0.attn_norm.weight"], torch.ones(32))
    assert torch.equal(params["blocks.0.attn.q_norm.weight"], torch.ones(cfg.head_dim))
    assert not params["blocks.0.attn.wq.bias"].any()
    assert abs(float(params["blocks.0.mlp.w_gate_up.weight"].std()) - std) < 0.1 * std
    scaled = std / (2 * cfg.n_layer) ** 0.5  # the projections into the residual stream
    assert abs(float(params["blocks.1.attn.wo.weight"].std()) - scaled) < 0.1 * scaled
    # no two weights of one shape share their values, and another seed draws others
    weights = [p for name, p in params.items() if name.endswith("wq.weight")]
    assert not torch.equal(weights[0], weights[1])
    torch.manual_seed(8)
    assert not torch.equal(Transformer(cfg).embed.weight, whole.embed.weight)
    # a tied head is the embedding, drawn once; the experts are drawn like linear weights
    assert whole.lm_head.weight is whole.embed.weight and "lm_head.weight" not in values
    moe = cfg.model_copy(update={"moe": MoEConfig(num_experts=4, top_k=2, expert_hidden=16)})
    torch.manual_seed(7)
    experts = Transformer(moe).blocks[0].mlp
    assert abs(float(experts.w_gate_up.std()) - std) < 0.1 * std
    assert abs(float(experts.w_down.std()) - scaled) < 0.1 * scaled


def test_autotp_splits_the_column_and_row_weights_the_column_biases_and_the_vocabulary_tables_asked_for():
    from lmfoundry.train.tensor_parallel import autotp_splits

    for name in ("blocks.0.attn.wq.weight", "blocks.3.attn.wkv.weight", "blocks.0.attn.wo.weight"):
        assert autotp_splits(name, vocab_parallel=False), name
    for name in ("blocks.1.mlp.w_gate_up.weight", "blocks.1.mlp.w_down.weight", "blocks.0.attn.wq.bias"):
        assert autotp_splits(name, vocab_parallel=False), name
    for name in ("blocks.0.attn.wo.bias", "blocks.0.attn.q_norm.weight", "blocks.0.attn_norm.weight", "norm.weight"):
        assert not autotp_splits(name, vocab_parallel=True), name
    assert not autotp_splits("lm_head.weight", vocab_parallel=False)
    assert autotp_splits("lm_head.weight", vocab_parallel=True) and autotp_splits("embed.weight", vocab_parallel=True)


@pytest.mark.parametrize("tied", [True, False])
def test_a_checkpoint_built_on_the_meta_device_reads_its_weights_one_at_a_time(tmp_path, tied):
    import shutil

    from lmfoundry.model.checkpoint import load_model_on_meta

    model = tiny(tie_embeddings=tied)
    with torch.no_grad():
        model.embed.weight.add_(1.0)  # trained: not its initial values
    save_model_files(model, tmp_path / "ckpt")
    loaded = dict(load_model_files(tmp_path / "ckpt").named_parameters())
    meta = load_model_on_meta(tmp_path / "ckpt")
    assert next(meta.parameters()).is_meta
    shutil.rmtree(tmp_path / "ckpt")  # a caller's temporary copy, gone: the open file is still read
    values = meta.initial_values()
    assert values.keys() == loaded.keys()
    for name, p in loaded.items():
        assert torch.equal(values[name](), p), name


def test_a_checkpoint_that_does_not_fit_its_config_is_refused_on_the_meta_device_by_name(tmp_path):
    import json

    from safetensors.torch import save_file

    from lmfoundry.model.checkpoint import MODEL_CONFIG, WEIGHTS, load_model_on_meta

    save_model_files(tiny(), tmp_path)
    config = json.loads((tmp_path / MODEL_CONFIG).read_text())
    (tmp_path / MODEL_CONFIG).write_text(json.dumps({**config, "d_model": 64, "n_head": 8}))
    with pytest.raises(ValueError, match="embed.weight has shape"):
        load_model_on_meta(tmp_path)
    save_file({"embed.weight": torch.zeros(97, 32)}, str(tmp_path / WEIGHTS))
    (tmp_path / MODEL_CONFIG).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing .*blocks.0.attn.wq.weight"):
        load_model_on_meta(tmp_path)


def test_a_crafted_weights_file_is_refused_on_the_meta_device_before_any_tensor_is_read(tmp_path):
    # an extra tensor (another model's, or a payload) and a file that is not safetensors at all
    from safetensors.torch import save_file

    from lmfoundry.model.checkpoint import WEIGHTS, load_model_on_meta

    model = tiny()
    save_model_files(model, tmp_path)
    state = {name: p.detach() for name, p in model.named_parameters()}
    save_file({**state, "../../etc/passwd": torch.zeros(1)}, str(tmp_path / WEIGHTS))
    with pytest.raises(ValueError, match=r"unexpected \['../../etc/passwd'\]"):
        load_model_on_meta(tmp_path)
    (tmp_path / WEIGHTS).write_bytes(b"\xff" * 8 + b"{not a header")
    with pytest.raises(Exception, match="(?i)header|invalid|deserializ"):
        load_model_on_meta(tmp_path)
