"""model.attention_length_scale (Scalable-Softmax): each query scaled by s_h log(n), n the keys it
sees, s_h learned per head from 1 / log(L); the same n whether a document is packed or alone, whole
or decoded through a cache, chunked or not."""
import math

import pytest
import torch

from model import KVCache
from training.builders import build_model

TINY = dict(name="t", n_layer=2, n_head=4, n_kv_head=2, d_model=32, vocab_size=None, max_seq_len=64,
            attention_length_scale=16)


def tiny(attention="naive", **changes):
    torch.manual_seed(0)
    model = build_model({**TINY, **changes}, vocab_size=50, attention=attention).double()
    with torch.no_grad():   # heads apart from their common start, so a wrong head index shows
        for block in model.blocks:
            block.attn.length_scale.copy_(torch.tensor([0.2, 0.3, 0.5, 0.7]))
    return model


def test_queries_are_scaled_by_the_log_of_the_keys_they_see():
    model = tiny()
    plain = build_model({**TINY, "attention_length_scale": None}, vocab_size=50, attention="naive").double()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "length_scale" not in k})
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    positions = torch.arange(10)
    _, rope = plain._embed(torch.zeros(2, 10, dtype=torch.long), positions)
    q0, k0, v0 = plain.blocks[0].attn.project(x, rope)
    q, k, v = model.blocks[0].attn.project(x, (*rope, model._log_keys_seen(positions, None)))
    s = torch.tensor([0.2, 0.3, 0.5, 0.7], dtype=torch.float64)
    expected = q0 * (torch.log(positions + 1.0)[:, None] * s)[None, :, :, None]
    torch.testing.assert_close(q, expected, rtol=1e-6, atol=0)   # log(n) is float32, as the RoPE table is
    assert torch.equal(k, k0) and torch.equal(v, v0)   # keys and values as they were


def test_it_starts_at_one_over_log_L_and_is_trained():
    torch.manual_seed(0)
    model = build_model(TINY, vocab_size=50, attention="sdpa")
    for block in model.blocks:
        torch.testing.assert_close(block.attn.length_scale, torch.full((4,), 1 / math.log(16)))
    idx = torch.randint(0, 50, (2, 12))
    model(idx, idx).backward()
    assert all(block.attn.length_scale.grad.abs().min() > 0 for block in model.blocks)


def test_the_window_bounds_the_keys_seen():
    model = build_model({**TINY, "attention_length_scale": 16}, vocab_size=50, attention="naive", window=4)
    seen = model._log_keys_seen(torch.arange(8), None).exp().round().squeeze(-1)
    assert seen.tolist() == [1, 2, 3, 4, 4, 4, 4, 4]


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
@pytest.mark.parametrize("reset_positions", [False, True])
def test_a_packed_document_reads_as_it_does_alone(attention, reset_positions):
    model = tiny(attention, reset_positions=reset_positions)
    a, b = torch.randint(0, 50, (1, 7)), torch.randint(0, 50, (1, 9))
    packed = torch.cat([a, b], 1)
    ids = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        together = model(packed, document_ids=ids)
        # without reset_positions RoPE still sees only distances; the scale must count from the document's start
        torch.testing.assert_close(together[:, 7:], model(b), rtol=0, atol=1e-10)
        torch.testing.assert_close(together[:, :7], model(a), rtol=0, atol=1e-10)


def test_decoding_through_the_cache_equals_one_forward():
    model = tiny()
    idx = torch.randint(0, 50, (2, 20))
    cache = KVCache(TINY["n_layer"], 2, 20)
    with torch.no_grad():
        parts = [model(idx[:, s:e], cache=cache) for s, e in ((0, 8), (8, 9), (9, 20))]
        torch.testing.assert_close(torch.cat(parts, 1), model(idx), rtol=0, atol=1e-10)


def test_block_chunks_equal_the_whole_sequence():
    whole = tiny(activation_checkpointing="full")
    chunked = tiny(activation_checkpointing="full", block_chunk_size=5)
    chunked.load_state_dict(whole.state_dict())
    idx = torch.randint(0, 50, (2, 16))
    torch.testing.assert_close(chunked(idx), whole(idx), rtol=0, atol=1e-10)


def test_unsupported_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="model.attention_length_scale=16 needs model.pos_emb=rope"):
        build_model({**TINY, "pos_emb": "learned"}, vocab_size=50, attention="naive")
    from training.interop.huggingface import hf_architecture

    with pytest.raises(ValueError, match="model.attention_length_scale=16 does not map to a Hugging Face"):
        hf_architecture(tiny().config)


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_generation_with_and_without_the_cache_agrees(mode):
    from model.generation import Sampling, decode

    model = tiny("naive")
    prompt = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        cached = list(decode(model, prompt, 8, Sampling(temperature=0), use_cache=True, mode=mode))
        whole = list(decode(model, prompt, 8, Sampling(temperature=0), use_cache=False))
    for (a, ta), (b, tb) in zip(cached, whole):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-8)
        assert torch.equal(ta, tb)
