"""q, k, v as slices of one fused QKV projection: the backward writes one packed gradient.

kernels/flash_op.py (`_projection`, `_EagerPackedAttention`) differentiates such a call with respect to
the projection itself, so autograd skips the split's backward (a concatenation of dq, dk, dv). The
gradient must be the very one the unpacked path gives, and every case where the split's backward
would do more than concatenate must take the unpacked path. CPU: Triton's interpreter; CUDA: bf16.
"""
import pytest
import torch

from conftest import HAS_CUDA, requires_hopper
from kernels import attention_reference, flash_attention
from kernels import flash_op

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
B, N, H, HKV, D = 2, 24, 4, 2, 32
WIDTH = (H + 2 * HKV) * D


@pytest.fixture
def packed_calls(monkeypatch):
    """How many calls took the packed path."""
    calls = []
    apply = flash_op._EagerPackedAttention.apply

    def counted(*args):
        calls.append(args[0].shape)
        return apply(*args)
    monkeypatch.setattr(flash_op._EagerPackedAttention, "apply", counted)
    return calls


def split(qkv, order=("q", "k", "v")):
    """The model's q, k, v: the projection split and unflattened (model/layers.py)."""
    widths = {"q": H * D, "k": HKV * D, "v": HKV * D}
    parts = dict(zip(order, qkv.split([widths[name] for name in order], dim=-1)))
    return tuple(parts[name].unflatten(-1, (-1, D)) for name in ("q", "k", "v"))


def fresh(seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, WIDTH, generator=g).to(DEVICE, DTYPE)
    dout = torch.randn(B, N, H, D, generator=g).to(DEVICE, DTYPE)
    return qkv, dout


def unpacked_grad(qkv, dout, **kw):
    """The gradient of the projection through three separate leaves, concatenated."""
    q, k, v = (t.detach().clone().requires_grad_() for t in split(qkv))
    grads = torch.autograd.grad(flash_attention(q, k, v, causal=True, **kw), (q, k, v), dout)
    return torch.cat([g.flatten(-2) for g in grads], dim=-1)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
def test_packed_gradient_is_the_unpacked_one(packed_calls, deterministic):
    qkv, dout = fresh()
    leaf = qkv.clone().requires_grad_()
    out = flash_attention(*split(leaf), causal=True, deterministic=deterministic)
    (grad,) = torch.autograd.grad(out, leaf, dout)
    assert len(packed_calls) == 1
    expected = unpacked_grad(qkv, dout, deterministic=deterministic)
    assert torch.isfinite(grad).all()
    if deterministic:
        assert torch.equal(grad, expected)
    else:   # dQ summed in arrival order: the last bits may differ
        torch.testing.assert_close(grad, expected)
    # and both are attention's gradient: the float64 reference's
    ref_leaf = qkv.double().requires_grad_()
    (ref,) = torch.autograd.grad(attention_reference(*split(ref_leaf), causal=True), ref_leaf, dout.double())
    assert ((grad.double() - ref).norm() / ref.norm()).item() < (1e-5 if DTYPE == torch.float32 else 2e-2)


def test_gradient_reaches_the_projection_weights_and_other_uses(packed_calls):
    """A non-leaf projection (x W^T), with q also used outside attention: autograd adds both
    contributions to the projection's gradient, then to x and W."""
    qkv, dout = fresh(1)
    x = torch.randn(B, N, 16, device=DEVICE, dtype=DTYPE)
    weight = torch.randn(WIDTH, 16, device=DEVICE, dtype=DTYPE) / 4

    def grads(attend):
        xs, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        q, k, v = attend(split(xs @ w.T))
        loss = (flash_attention(q, k, v, causal=True) * dout).sum() + (q.float() ** 2).sum()
        return torch.autograd.grad(loss, (xs, w))

    packed = grads(lambda views: views)
    assert len(packed_calls) == 1
    separate = grads(lambda views: tuple(t.clone() for t in views))   # copies: the unpacked path
    assert len(packed_calls) == 1
    for a, b in zip(packed, separate):
        torch.testing.assert_close(a, b, rtol=1e-5 if DTYPE == torch.float32 else 1e-2, atol=1e-5)


def test_sinks_gradient_on_the_packed_path(packed_calls):
    qkv, dout = fresh(2)
    sinks = torch.randn(H, device=DEVICE, requires_grad=True)
    leaf = qkv.clone().requires_grad_()
    grad, dsinks = torch.autograd.grad(flash_attention(*split(leaf), causal=True, sinks=sinks), (leaf, sinks), dout)
    assert len(packed_calls) == 1
    q, k, v = (t.detach().clone().requires_grad_() for t in split(qkv))
    *expected, dsinks_expected = torch.autograd.grad(flash_attention(q, k, v, causal=True, sinks=sinks),
                                                     (q, k, v, sinks), dout)
    assert torch.equal(grad, torch.cat([g.flatten(-2) for g in expected], dim=-1))
    assert torch.equal(dsinks, dsinks_expected)


def _views(leaf, case):
    if case == "k-q-v order":
        return split(leaf, order=("k", "q", "v"))
    if case == "modified in place":   # a slice of the projection written in place: CopySlices in its history
        base = leaf * 1
        base[..., : H * D].mul_(0.5)
        return split(base)
    views = split(leaf)
    if case == "retained q":
        views[0].retain_grad()
    elif case == "hooked k":
        views[1].register_hook(lambda g: g * 2)
    return views


@pytest.mark.parametrize("case", ["k-q-v order", "retained q", "hooked k", "modified in place"])
def test_unpacked_path_where_the_split_does_more(packed_calls, case):
    """Other orders, retained or hooked views, a projection written in place through a slice: the split's
    backward may do more than concatenate there (the last is refused conservatively), so the call runs
    unpacked, and autograd's answer stands: the one it
    gives when attention reads copies of the views."""
    qkv, dout = fresh(3)
    leaf = qkv.clone().requires_grad_()
    views = _views(leaf, case)
    (grad,) = torch.autograd.grad(flash_attention(*views, causal=True), leaf, dout, retain_graph=True)
    assert not packed_calls
    if case == "retained q":
        assert views[0].grad is not None
    other = qkv.clone().requires_grad_()
    (expected,) = torch.autograd.grad(flash_attention(*(t.clone() for t in _views(other, case)), causal=True),
                                      other, dout)
    assert torch.isfinite(grad).all() and torch.equal(grad, expected)


def test_no_grad_call_is_unpacked(packed_calls):
    qkv, _ = fresh(4)
    leaf = qkv.clone().requires_grad_()
    with torch.no_grad():
        out = flash_attention(*split(leaf), causal=True)
    assert not packed_calls and out.grad_fn is None
    torch.testing.assert_close(out, flash_attention(*split(qkv), causal=True), rtol=0, atol=0)


@requires_hopper
@pytest.mark.parametrize("heads", [(12, 12), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("kernel", ["gluon", "triton"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
def test_packed_gradient_on_the_gpu(packed_calls, heads, kernel, deterministic):
    """gpt2-small's head dim at a length where each plan runs its own backward (the Gluon one
    writes dk and dv through TMA descriptors of the packed gradient's slices)."""
    (h, h_kv), d, n = heads, 64, 1000
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, n, (h + 2 * h_kv) * d, generator=g).to("cuda", torch.bfloat16)
    dout = torch.randn(2, n, h, d, generator=g).to("cuda", torch.bfloat16)
    sizes = [h * d, h_kv * d, h_kv * d]
    leaf = qkv.clone().requires_grad_()
    views = [t.unflatten(-1, (-1, d)) for t in leaf.split(sizes, -1)]
    out = flash_attention(*views, causal=True, kernel=kernel, deterministic=deterministic)
    (grad,) = torch.autograd.grad(out, leaf, dout)
    assert len(packed_calls) == 1
    copies = [t.unflatten(-1, (-1, d)).detach().clone().requires_grad_() for t in qkv.split(sizes, -1)]
    grads = torch.autograd.grad(flash_attention(*copies, causal=True, kernel=kernel, deterministic=deterministic),
                                copies, dout)
    expected = torch.cat([t.flatten(-2) for t in grads], dim=-1)
    assert torch.isfinite(grad).all()
    if deterministic:
        assert torch.equal(grad, expected)
    else:
        torch.testing.assert_close(grad, expected, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
@pytest.mark.parametrize("pos_emb", ["learned", pytest.param("rope", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="the model rotates with kernels/rotary.py on CUDA; on the CPU q and k are new tensors"))])
def test_the_model_takes_the_packed_path(packed_calls, monkeypatch, checkpointing, pos_emb):
    """A GPT hands attention the split of its fused projection (with rotary positions, of the new
    fused tensor kernels/rotary.py writes): every layer takes the packed path, and the model's
    gradients are the unpacked path's, bit for bit."""
    from training.builders import build_model

    config = dict(name="t", n_layer=2, n_head=4, n_kv_head=2, d_model=64, vocab_size=None, max_seq_len=32,
                  pos_emb=pos_emb, activation_checkpointing=checkpointing)
    idx = torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(6)).to(DEVICE)

    def grads():
        torch.manual_seed(0)
        model = build_model(config, vocab_size=50, attention="flash").to(DEVICE)
        model(idx, idx).backward()
        return [p.grad for p in model.parameters()]

    packed = grads()
    assert len(packed_calls) == 2
    monkeypatch.setattr(flash_op, "_projection", lambda q, k, v: None)
    unpacked = grads()
    assert len(packed_calls) == 2
    for a, b in zip(packed, unpacked):
        assert torch.equal(a, b)
