"""Generation with a KV cache: same tokens and logits as recomputing the whole sequence each step."""
import pytest
import torch

from model import KVCache
from training.builders import build_model
from model.generation import Sampling, decode, next_tokens
from model.rope import rope_cos_sin, rope_table

TINY = dict(name="t", n_layer=2, n_head=4, n_kv_head=2, d_model=64, vocab_size=None, max_seq_len=48)
VOCAB = 50
FLASH_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # on the CPU: Triton's interpreter


def tiny(attention="sdpa", dtype=torch.float64, **changes):
    torch.manual_seed(0)
    model = build_model({**TINY, **changes}, vocab_size=VOCAB, attention=attention)
    return model.to(FLASH_DEVICE if attention == "flash" else "cpu", dtype).eval()


def tokens(model, *shape):
    return torch.randint(0, VOCAB, shape).to(model.lm_head.weight.device)


def run(model, prompt, steps, use_cache, sampling=Sampling(temperature=0), seed=None, mode="eager"):
    generator = None if seed is None else torch.Generator(prompt.device).manual_seed(seed)
    out = list(decode(model, prompt, steps, sampling, generator=generator, vocab_size=VOCAB, use_cache=use_cache,
                      mode=mode))
    return torch.stack([l for l, _ in out], 1), torch.stack([t for _, t in out], 1)


@pytest.mark.parametrize("attention,dtype,tol,pos_emb", [
    ("naive", torch.float64, 1e-10, "rope"),
    ("naive", torch.float64, 1e-10, "learned"),
    ("sdpa", torch.float64, 1e-10, "rope"),
    ("sdpa", torch.float64, 1e-10, "learned"),
    ("flash", torch.float32, 2e-5, "rope"),   # our kernel in Triton's interpreter (slow: one case)
])
def test_cached_greedy_decoding_equals_recomputing(attention, dtype, tol, pos_emb):
    model = tiny(attention, dtype, pos_emb=pos_emb)
    prompt = tokens(model, 2, 7)
    steps = 4 if attention == "flash" else 12
    cached_logits, cached = run(model, prompt, steps, use_cache=True)
    full_logits, full = run(model, prompt, steps, use_cache=False)
    assert torch.equal(cached, full)
    torch.testing.assert_close(cached_logits, full_logits, rtol=0, atol=tol)
    # and the first step is the plain forward's last position
    torch.testing.assert_close(cached_logits[:, 0, :VOCAB], model(prompt)[:, -1, :VOCAB].float(), rtol=0, atol=tol)


@pytest.mark.parametrize("attention,dtype,tol,changes", [
    ("naive", torch.float64, 1e-10, {}),
    ("sdpa", torch.float64, 1e-10, {}),
    ("sdpa", torch.float64, 1e-10, {"pos_emb": "learned"}),
    ("flash", torch.float32, 2e-5, {}),   # kernels/decode.py in Triton's interpreter
])
def test_static_cache_decoding_equals_the_eager_cache(attention, dtype, tol, changes):
    """The static cache's fixed-shape steps (device-side position, the decode entry over the whole
    buffer) give the eager cache's greedy tokens and logits."""
    model = tiny(attention, dtype, **changes)
    prompt = tokens(model, 2, 7)
    steps = 6 if attention == "flash" else 20
    eager_logits, eager = run(model, prompt, steps, use_cache=True)
    static_logits, static = run(model, prompt, steps, use_cache=True, mode="static")
    assert torch.equal(static, eager)
    torch.testing.assert_close(static_logits, eager_logits, rtol=0, atol=tol)


@pytest.mark.parametrize("attention,dtype,tol", [("naive", torch.float64, 1e-10), ("flash", torch.float32, 2e-5)])
def test_soft_capped_models_with_sinks_decode_as_they_recompute(attention, dtype, tol):
    """model.attention_softcap and model.attention_sinks through the eager cache (the attention entry)
    and the static one (its decode entry: kernels/decode.py for flash): the tokens and logits of
    recomputing the whole sequence each step."""
    model = tiny(attention, dtype, attention_softcap=0.02, attention_sinks=True)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sinks.normal_()
    prompt = tokens(model, 2, 7)
    steps = 4 if attention == "flash" else 10
    full_logits, full = run(model, prompt, steps, use_cache=False)
    for mode in ("eager", "static"):
        logits, generated = run(model, prompt, steps, use_cache=True, mode=mode)
        assert torch.equal(generated, full), mode
        torch.testing.assert_close(logits, full_logits, rtol=0, atol=tol)


@pytest.mark.parametrize("attention", ["sdpa", "naive"])
def test_static_cache_keeps_a_sliding_window(attention):
    torch.manual_seed(0)
    model = build_model(TINY, vocab_size=VOCAB, attention=attention, window=5).to(torch.float64).eval()
    prompt = tokens(model, 1, 9)
    eager_logits, eager = run(model, prompt, 12, use_cache=True)
    static_logits, static = run(model, prompt, 12, use_cache=True, mode="static")
    full_logits, _ = run(model, prompt, 12, use_cache=False)
    assert torch.equal(static, eager)
    torch.testing.assert_close(static_logits, full_logits, rtol=0, atol=1e-10)


def test_graph_mode_is_refused_without_cuda_and_unknown_modes_are_named():
    model = tiny()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="decode mode 'graph' needs a CUDA device"):
            next(decode(model, torch.zeros(1, 3, dtype=torch.long), 2, mode="graph"))
    with pytest.raises(ValueError, match="decode mode 'fast': expected one of eager, static, graph"):
        next(decode(model, torch.zeros(1, 3, dtype=torch.long), 2, mode="fast"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["flash", "sdpa"])
def test_cuda_graph_decoding_equals_the_static_steps_to_the_bit(attention):
    torch.manual_seed(0)
    model = build_model({**TINY, "max_seq_len": 256}, vocab_size=VOCAB, attention=attention).cuda().to(torch.bfloat16).eval()
    prompt = torch.randint(0, VOCAB, (2, 33), device="cuda")
    static_logits, static = run(model, prompt, 40, use_cache=True, mode="static")
    graph_logits, graph = run(model, prompt, 40, use_cache=True, mode="graph")
    assert torch.equal(graph, static) and torch.equal(graph_logits, static_logits)


def test_cached_sampling_with_a_seed_is_reproducible_and_equals_recomputing():
    model = tiny()
    prompt = torch.randint(0, VOCAB, (3, 5))
    sampling = Sampling(temperature=0.9, top_k=20, top_p=0.95)
    _, a = run(model, prompt, 10, True, sampling, seed=1)
    _, b = run(model, prompt, 10, True, sampling, seed=1)
    _, c = run(model, prompt, 10, False, sampling, seed=1)
    _, d = run(model, prompt, 10, True, sampling, seed=2)
    assert torch.equal(a, b) and torch.equal(a, c) and not torch.equal(a, d)


@pytest.mark.parametrize("attention,dtype,tol", [
    ("naive", torch.float64, 1e-10), ("sdpa", torch.float64, 1e-10), ("flash", torch.float32, 2e-5),
])
def test_prefill_in_chunks_equals_one_prefill(attention, dtype, tol):
    """A chunk of several new queries against a filled cache (bottom-right causal alignment)."""
    model = tiny(attention, dtype)
    idx = tokens(model, 2, 20)
    cache = KVCache(TINY["n_layer"], 2, 20)
    with torch.no_grad():
        parts = [model(idx[:, s:e], cache=cache) for s, e in ((0, 8), (8, 9), (9, 20))]
        torch.testing.assert_close(torch.cat(parts, 1), model(idx), rtol=0, atol=tol)
    assert cache.length == 20


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
def test_positions_offset_and_tensor_agree(pos_emb):
    model = tiny(pos_emb=pos_emb)
    idx = torch.randint(0, VOCAB, (2, 6))
    by_offset = model(idx, positions=5)
    torch.testing.assert_close(model(idx, positions=torch.arange(5, 11)), by_offset, rtol=0, atol=0)
    torch.testing.assert_close(model(idx, positions=torch.arange(5, 11).expand(2, 6)), by_offset, rtol=0, atol=0)
    # RoPE sees only distances (a shift changes nothing), learned positions see absolute ones
    gaps = model(idx, positions=torch.tensor([0, 1, 2, 20, 21, 22]))
    assert (gaps - model(idx)).abs().max() > 1e-6
    assert ((by_offset - model(idx)).abs().max() > 1e-6) == (pos_emb == "learned")
    with pytest.raises(ValueError, match="sequence length 49 exceeds model.max_seq_len=48"):
        model(idx, positions=43)


def test_rope_at_an_offset_is_a_slice_of_the_full_table():
    cos, sin = rope_cos_sin(40, 16, 10000.0, "cpu")
    cos_at, sin_at = rope_table(torch.arange(30, 38), 16, 10000.0)
    assert torch.equal(cos_at, cos[30:38]) and torch.equal(sin_at, sin[30:38])
    model = tiny()
    with pytest.raises(ValueError, match="one position per token"):
        model(tokens(model, 1, 3), positions=torch.arange(4))


def test_sampling_truncation():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).repeat(200, 1)
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(next_tokens(logits, Sampling(temperature=0)), torch.full((200,), 1))
    assert torch.equal(next_tokens(logits, Sampling(top_k=1), gen), torch.full((200,), 1))
    assert set(next_tokens(logits, Sampling(top_k=2), gen).tolist()) == {1, 3}
    # probabilities 0.64, 0.24, 0.09, 0.03: the nucleus of 0.8 is the top two
    assert set(next_tokens(logits, Sampling(top_p=0.8), gen).tolist()) == {1, 3}
    assert set(next_tokens(logits, Sampling(top_p=1.0, temperature=5.0), gen).tolist()) == {0, 1, 2, 3}
    for bad in (dict(temperature=-1), dict(temperature=float("inf")), dict(temperature=float("nan")),
                dict(top_k=-1), dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_padding_rows_of_the_head_are_never_chosen():
    model = tiny()
    assert model.config.vocab_size == 64
    with torch.no_grad():
        model.lm_head.weight[VOCAB:] = 10.0   # would win every argmax
    _, chosen = run(model, torch.randint(0, VOCAB, (2, 4)), 5, True)
    assert chosen.max() < VOCAB


def test_prompt_longer_than_the_context_is_refused():
    model = tiny()
    with pytest.raises(ValueError, match="the prompt has 49 tokens, more than the model's context"):
        next(decode(model, torch.zeros(1, 49, dtype=torch.long), 4))
    # a prompt that fits generates only up to the context
    assert len(list(decode(model, torch.zeros(1, 45, dtype=torch.long), 10))) == 3
