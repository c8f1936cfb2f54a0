"""The attention registry: naive and SDPA agree exactly, names resolve or fail clearly."""
from pathlib import Path

import pytest
import torch

from kernels.reference import attention_reference
import model.attention as attention_module
from kernels import flash_attention
from model.attention import ATTENTION, get_attention, resolve_attention


def _qkv(n_q=24, n_k=24, heads=4, kv_heads=4, head_dim=16, fused=False):
    """float64 q (B, Nq, H, D), k/v (B, Nk, Hkv, D); `fused` returns strided views of one
    projection-like buffer, as the model hands them over."""
    g = torch.Generator().manual_seed(0)
    if fused:
        assert n_q == n_k
        buf = torch.randn(2, n_q, (heads + 2 * kv_heads) * head_dim, generator=g, dtype=torch.float64)
        q, k, v = buf.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return tuple(t.unflatten(-1, (-1, head_dim)) for t in (q, k, v))
    q = torch.randn(2, n_q, heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(2, n_k, kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(2, n_k, kv_heads, head_dim, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("fused", [False, True], ids=["contiguous", "strided"])
def test_naive_equals_sdpa_float64(causal, kv_heads, fused):
    q, k, v = _qkv(kv_heads=kv_heads, fused=fused)
    if fused:
        assert not q.is_contiguous()
    naive = get_attention("naive")(q, k, v, causal=causal)
    sdpa = get_attention("sdpa")(q, k, v, causal=causal)
    assert sdpa.shape == q.shape
    torch.testing.assert_close(sdpa, naive, rtol=1e-12, atol=1e-12)


def test_sdpa_causal_is_bottom_right_aligned_and_scaled():
    q, k, v = _qkv(n_q=7, n_k=19, kv_heads=2)
    want = attention_reference(q, k, v, causal=True, softmax_scale=0.3)
    got = get_attention("sdpa")(q, k, v, causal=True, softmax_scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_sdpa_gradients_match_naive():
    q, k, v = (t.requires_grad_() for t in _qkv(kv_heads=2))
    grads = {}
    for name in ("naive", "sdpa"):
        out = get_attention(name)(q, k, v, causal=True)
        grads[name] = torch.autograd.grad((out * out).sum(), (q, k, v))
    for g_naive, g_sdpa in zip(grads["naive"], grads["sdpa"]):
        torch.testing.assert_close(g_sdpa, g_naive, rtol=1e-10, atol=1e-10)


def test_sdpa_rejects_heads_not_a_multiple():
    q, k, v = _qkv(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="not a multiple"):
        get_attention("sdpa")(q, k, v)


def test_naive_is_the_reference_itself():
    assert ATTENTION["naive"] is attention_reference


def test_resolve_auto_picks_sdpa_on_cpu():
    assert resolve_attention("auto", "cpu") == "sdpa"
    assert resolve_attention("auto", "cpu", score_options=True) == "naive"   # SDPA has no soft-capping, no sinks
    assert resolve_attention("naive", torch.device("cpu")) == "naive"


def test_resolve_auto_on_cuda_wants_flash():
    assert ATTENTION["flash"] is flash_attention
    assert resolve_attention("auto", "cuda") == "flash"
    assert resolve_attention("auto", "cuda", score_options=True) == "flash"


@pytest.fixture
def one_thread():
    """4,000 calls on a few hundred numbers each: a second OpenMP thread only waits, and while other
    work holds the cores its spin-waits slow the calls down (3x with both of 2 cores busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sdpa_attention_dropout_drops_probabilities_unbiasedly(one_thread):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    exact = ATTENTION["sdpa"](q, k, v, causal=True)
    draws = torch.stack([ATTENTION["sdpa"](q, k, v, causal=True, dropout_p=0.5) for _ in range(4000)])
    # The first query sees only the first key: probability 1, kept (scaled by 1/(1-p)) or dropped.
    first = draws[:, :, 0] / v[:, 0]
    assert torch.all(((first - 2).abs() < 1e-9) | (first.abs() < 1e-9))
    assert 0.45 < (first.abs() > 1).double().mean() < 0.55
    torch.testing.assert_close(draws.mean(0), exact, atol=0.12, rtol=0)   # unbiased: E[dropped] = exact
    assert (draws.std(0) > 0.01).all()


def test_flash_on_cpu_without_interpreter_is_refused_up_front(monkeypatch):
    monkeypatch.setattr(attention_module, "INTERPRET", False)
    with pytest.raises(ValueError, match="attention=flash needs a CUDA device") as refused:
        resolve_attention("flash", "cpu")
    assert "TRITON_INTERPRET=1" in str(refused.value) and "about a minute per step" in str(refused.value)


@pytest.mark.parametrize("options", [{}, {"attention_softcap": 0.02, "attention_sinks": True}], ids=["plain", "scores"])
def test_flash_in_the_model_matches_naive(options):
    """The registry's flash entry inside a real GPT, with either backward: same loss and
    gradients as naive (float32; on CPU through Triton's interpreter); with a soft cap that bends
    the initial scores and sinks, the sinks' gradients included."""
    from omegaconf import OmegaConf
    from training.builders import build_model   # the schema's checks, then model.build_model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = OmegaConf.load(Path(__file__).parents[1] / "configs" / "model" / "tiny.yaml")
    cfg.merge_with({"n_layer": 2, "d_model": 64, "n_head": 4, "n_kv_head": 2, **options})
    idx = torch.randint(0, 256, (2, 40), device=device)
    results = {}
    for name, deterministic in (("naive", True), ("flash", True), ("flash", False)):
        torch.manual_seed(0)
        model = build_model(cfg, vocab_size=256, attention=name, deterministic=deterministic).to(device)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results[name, deterministic] = (loss.detach(), [p.grad for p in model.parameters()])
    for flash in (("flash", True), ("flash", False)):
        torch.testing.assert_close(results[flash][0], results["naive", True][0], rtol=1e-5, atol=1e-5)
        for g_flash, g_naive in zip(results[flash][1], results["naive", True][1]):
            torch.testing.assert_close(g_flash, g_naive, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value", [True, False])
def test_attention_deterministic_reaches_the_kernel(value):
    """`attention.deterministic` (configs/attention/shared/keys.yaml) goes from the config to
    the function every block calls."""
    from training.config import compose
    from training.builders import model_from_config
    cfg = compose(["attention=flash", f"attention.deterministic={str(value).lower()}", "run.dir=x"])
    assert cfg.attention.deterministic is value
    fn = model_from_config(cfg, vocab_size=256).blocks[0].attn.attention
    assert fn is flash_attention if value else fn.keywords == {"deterministic": False}


def test_attention_deterministic_must_be_a_bool():
    with pytest.raises(ValueError, match="attention.deterministic must be true or false"):
        get_attention("flash", "no")


@pytest.mark.parametrize("bad", ["flsh", "auto", "Naive"])
def test_unknown_names_list_valid_ones(bad):
    with pytest.raises(ValueError, match="valid: naive, sdpa") as info:
        get_attention(bad)
    assert repr(bad) in str(info.value)
    if bad != "auto":
        with pytest.raises(ValueError, match="valid: naive, sdpa"):
            resolve_attention(bad, "cpu")
