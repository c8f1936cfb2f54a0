"""Memory features are exact: activation checkpointing and chunked cross-entropy give the
same loss and gradients as the plain model (float64), and the forward compiles whole."""
import pytest
import torch
import torch.nn.functional as F

from training.builders import build_model   # the schema's checks, then model.build_model
from model.losses import chunked_linear_cross_entropy

TINY = dict(name="t", n_layer=2, n_head=4, n_kv_head=2, d_model=32, vocab_size=None, max_seq_len=64)


def loss_and_grads(attention="sdpa", seed=0, dtype=torch.float64, **changes):
    """Loss and parameter gradients of a float64 tiny model built from `seed` (weights and data);
    float32 for our kernel (on a CPU in Triton's interpreter)."""
    device = "cuda" if attention == "flash" and torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    model = build_model({**TINY, **changes}, vocab_size=50, attention=attention).to(device, dtype).train()
    idx = torch.randint(0, 50, (2, 24), device=device)
    targets = torch.randint(0, 50, (2, 24), device=device)
    targets[1, :7] = -100
    torch.manual_seed(seed + 1)    # same dropout masks in every variant
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_same(a, b):
    loss_a, grads_a = a
    loss_b, grads_b = b
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=1e-12)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_activation_checkpointing_is_exact(mode, attention):
    plain = loss_and_grads(attention)
    assert_same(plain, loss_and_grads(attention, activation_checkpointing=mode))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_replays_dropout(mode):
    plain = loss_and_grads(dropout=0.2, pos_emb="learned", norm="layernorm", mlp="gelu", bias=True)
    assert_same(plain, loss_and_grads(dropout=0.2, pos_emb="learned", norm="layernorm", mlp="gelu",
                                      bias=True, activation_checkpointing=mode))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_replays_attention_dropout_in_our_kernel(mode):
    """Full checkpointing reruns the attention forward in the backward: its dropout seed is drawn
    again from the replayed generator, so its mask, and the loss and gradients, are the plain
    model's; selective keeps the seed the forward drew."""
    plain = loss_and_grads("flash", dtype=torch.float32, attention_dropout=0.3)
    assert_same(plain, loss_and_grads("flash", dtype=torch.float32, attention_dropout=0.3,
                                      activation_checkpointing=mode))


def _saved_activation_bytes(mode, seq_len=256):
    """Bytes autograd holds after forward (what checkpointing is meant to cut)."""
    torch.manual_seed(0)
    model = build_model({**TINY, "max_seq_len": seq_len, "activation_checkpointing": mode},
                        vocab_size=50, attention="sdpa")
    idx = torch.randint(0, 50, (1, seq_len))
    saved = {}

    def pack(t):
        saved[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for (ptr, _), n in saved.items() if ptr not in params)


def test_checkpointing_saves_less():
    none, selective, full = (_saved_activation_bytes(m) for m in ("none", "selective", "full"))
    assert full < selective < none


@pytest.mark.parametrize("chunk", [1, 7, 16, 48, 1000])
@pytest.mark.parametrize("tie", [True, False])
def test_chunked_cross_entropy_is_exact_in_the_model(chunk, tie):
    plain = loss_and_grads(tie_embeddings=tie)
    assert_same(plain, loss_and_grads(tie_embeddings=tie, loss_chunk_size=chunk))


def test_chunked_cross_entropy_with_checkpointing():
    plain = loss_and_grads()
    assert_same(plain, loss_and_grads(loss_chunk_size=10, activation_checkpointing="full"))


def test_chunked_cross_entropy_function():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(29, 16, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 29, (37,), generator=g)
    targets[::3] = -100
    want = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=-100)
    got = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    torch.testing.assert_close(got.double(), want, rtol=1e-12, atol=1e-12)
    # a non-unit upstream gradient scales both input gradients
    want_grads = torch.autograd.grad(3.0 * want, (hidden, weight))
    got_grads = torch.autograd.grad(3.0 * got, (hidden, weight))
    for w, g_ in zip(want_grads, got_grads):
        assert g_.dtype == torch.float64
        torch.testing.assert_close(g_, w, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(chunked_linear_cross_entropy(hidden, weight, targets, 5).double(), want.detach())


def test_chunked_cross_entropy_holds_one_chunk_of_logits():
    """The largest tensor autograd keeps is the hidden-state gradient, never (tokens x vocab)."""
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(500, 8, requires_grad=True)
    targets = torch.randint(0, 500, (64,))
    largest = []

    def pack(t):
        largest.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=4)
    assert max(largest) <= 500 * 8


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size must be positive, got 0"):
        chunked_linear_cross_entropy(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), 0)


@pytest.mark.parametrize("attention, changes", [
    ("naive", {}),
    ("sdpa", {}),
    ("sdpa", {"activation_checkpointing": "selective", "loss_chunk_size": 8}),
])
def test_forward_compiles_without_graph_breaks(attention, changes):
    torch.manual_seed(0)
    model = build_model({**TINY, **changes}, vocab_size=50, attention=attention)
    idx = torch.randint(0, 50, (2, 16))
    explanation = torch._dynamo.explain(model)(idx, idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons
