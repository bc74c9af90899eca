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
