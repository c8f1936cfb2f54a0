"""Which kernels run a flash_attention call: the kernel plan (kernels/plan.py), on the CPU.

The rules: what `auto` picks, the one-line refusals of `gluon`, the words per direction. Then the
composition, which each half's own test cannot see: a config composed as train.py composes it, the
plan the run records (`attention.plan` in config.yaml), the model built from that config, and one
forward and backward through the real dispatch with every kernel launch recorded instead of run (as
scripts/bench/bench_attention_host.py --stub does), the GPU's architecture faked as a Hopper's. The
kernels that launched in each direction must be the plan's, and the plans must be those
docs/attention.md's table states.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import HAS_CUDA
from kernels import flash_attention, gluon
from kernels import plan as kernel_plan
from kernels.plan import Setting, plan_kernels

REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def fresh_plans():
    """Plans are cached per Setting for the life of a process (the tuning switches they read are
    fixed at import); tests that patch those switches start and leave with an empty cache."""
    plan_kernels.cache_clear()
    yield
    plan_kernels.cache_clear()


def setting(**changes) -> Setting:
    base = dict(arch="sm_90", dtype=torch.bfloat16, head_dim=64, causal=True, mask="none", length=8192, tma=True,
                deterministic=True)
    return Setting(**{**base, **changes})


def test_unknown_kernel_is_refused():
    q = torch.randn(1, 8, 2, 64, device=DEVICE, dtype=torch.float16)
    for bad in ("cudnn", ("gluon",), ["triton", "triton"]):
        with pytest.raises(ValueError, match="kernel must be one of auto, triton, gluon, or a .forward, backward. pair"):
            flash_attention(q, q, q, kernel=bad)


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors")
def test_gluon_on_cpu_is_refused_and_auto_runs_triton():
    q, k, v = (torch.randn(1, 40, 2, 64) for _ in range(3))
    with pytest.raises(ValueError, match="kernel='gluon' cannot run the forward of this call: it needs a CUDA device"):
        flash_attention(q, k, v, kernel="gluon")
    with pytest.raises(ValueError, match="cannot run the backward of this call"):
        flash_attention(q, k, v, kernel=("triton", "gluon"))
    assert torch.equal(flash_attention(q, k, v, kernel="auto"), flash_attention(q, k, v, kernel="triton"))


@pytest.mark.parametrize("changes, match", [
    (dict(dtype=torch.float32), "float16 and bfloat16"),
    (dict(head_dim=80), "head dims 64, 128, got 80"),
    (dict(mask="window"), "sliding windows and key bounds run on the Triton kernel"),
    (dict(mask="key_bounds"), "key bounds"),
    (dict(tma=False), "a view TMA cannot read"),
    (dict(arch="sm_80"), r"written for Hopper \(sm_90\); this GPU is sm_80"),
    (dict(arch=None), "needs a CUDA device"),
])
def test_settings_the_gluon_kernels_refuse(changes, match):
    """kernel='gluon' names each reason in one line; 'auto' runs Triton in both directions for all of them."""
    for direction in ("forward", "backward"):
        with pytest.raises(ValueError, match=f"cannot run the {direction} of this call: .*{match}"):
            plan_kernels(setting(**changes, **{direction: "gluon"}))
    plan = plan_kernels(setting(**changes, length=1 << 20))
    assert (plan.forward.family, plan.backward.family) == ("triton", "triton")


def test_causal_documents_run_the_gluon_backward():
    """The Gluon backward takes causal document masks; the Gluon forward none, nor the backward
    without causal: each refusal in one line, and `auto` keeps the Gluon backward where it runs
    without a mask."""
    with pytest.raises(ValueError, match="cannot run the forward of this call: document masks, sliding windows"):
        plan_kernels(setting(mask="documents", forward="gluon"))
    assert plan_kernels(setting(mask="documents", backward="gluon")).backward.family == "gluon"
    with pytest.raises(ValueError, match="cannot run the backward of this call: its document masks are causal"):
        plan_kernels(setting(mask="documents", causal=False, backward="gluon"))
    for length in (1024, 1 << 20):
        plan, plain = plan_kernels(setting(mask="documents", length=length)), plan_kernels(setting(length=length))
        assert plan.forward.family == "triton" and plan.backward.family == plain.backward.family


@pytest.mark.parametrize("option", ["sinks", "softcap", "dropout"])
def test_score_options_run_on_the_gluon_kernels(option):
    """Both Gluon kernels compute dropout, soft-capping and sinks (the backward takes the sinks in
    through the forward's LSE, caps the scores it recomputes and regenerates the forward's dropout
    mask), so 'gluon' runs either direction and 'auto' keeps Gluon where it was measured faster."""
    plan = plan_kernels(setting(**{option: True}, length=1 << 20))
    assert plan.backward.family == "gluon"
    assert plan.forward.family == ("triton" if option == "softcap" else "gluon")   # GLUON_FROM_SCORES
    for direction in ("forward", "backward"):
        assert getattr(plan_kernels(setting(**{option: True}, **{direction: "gluon"})), direction).family == "gluon"


@pytest.mark.parametrize("head_dim, causal, length, want", [
    (128, True, 1024, "gluon"), (128, True, 16384, "gluon"), (128, False, 4096, "triton"), (128, False, 16384, "gluon"),
    (64, True, 1024, "triton"), (64, True, 4096, "triton"), (64, True, 16384, "gluon"), (64, False, 16384, "gluon"),
    (64, True, 512, "triton"),
])
def test_auto_runs_the_gluon_forward_only_where_it_was_measured_faster(head_dim, causal, length, want):
    plan = plan_kernels(setting(head_dim=head_dim, causal=causal, length=length))
    assert plan.forward.family == want
    assert (want == "gluon") == (length >= kernel_plan.GLUON_FROM[("forward", head_dim, causal)])


@pytest.mark.parametrize("options, direction, length, want", [
    (dict(dropout=True), "forward", 2048, "triton"), (dict(dropout=True), "forward", 4096, "gluon"),
    (dict(dropout=True), "forward", 16384, "gluon"),
    (dict(softcap=True), "forward", 1 << 20, "triton"), (dict(dropout=True, softcap=True), "forward", 1 << 20, "triton"),
    (dict(dropout=True, softcap=True), "backward", 2048, "triton"), (dict(dropout=True, softcap=True), "backward", 4096, "gluon"),
    (dict(sinks=True, dropout=True), "backward", 1024, "gluon"),
])
def test_several_score_options_take_the_gluon_kernel_where_it_was_faster_with_each(options, direction, length, want):
    """Head dim 64 causal: the longest of the options' lengths (GLUON_FROM_SCORES, then GLUON_FROM)."""
    assert getattr(plan_kernels(setting(head_dim=64, causal=True, length=length, **options)), direction).family == want


@pytest.mark.parametrize("dropout, length, want", [
    (False, 1024, "triton"), (True, 512, "triton"), (True, 1024, "gluon"), (True, 2048, "gluon"),
    (False, 4096, "gluon"),
])
def test_dropout_takes_the_gluon_backward_from_where_it_was_measured_faster(dropout, length, want):
    """Head dim 64 causal: the Gluon backward from 4K, and with dropout (one draw of the mask against
    the Triton backward's two) from 1K, as GLUON_FROM_SCORES records."""
    plan = plan_kernels(setting(head_dim=64, causal=True, length=length, dropout=dropout))
    assert plan.backward.family == want
    assert plan.forward.family == "triton"


def test_words_per_direction_and_determinism():
    plan = plan_kernels(setting(forward="gluon", backward="triton", deterministic=False))
    assert (plan.forward.family, plan.backward.name) == ("gluon", "triton-atomic") and not plan.deterministic
    plan = plan_kernels(setting(forward="triton", backward="gluon"))
    assert (plan.forward.family, plan.backward.name) == ("triton", "gluon-deterministic") and plan.deterministic


def test_tiles_are_named_where_they_are_fixed(monkeypatch):
    """Autotuned up to tuning.TUNE_MAX_TOKENS, the pinned tile past it (and under FLASHTRAIN_AUTOTUNE=0)."""
    from kernels import tuning
    monkeypatch.setattr(tuning, "INTERPRET", False)
    monkeypatch.setattr(tuning, "AUTOTUNE", True)
    plan = plan_kernels(setting(length=4096, forward="triton"))
    assert str(plan.forward) == "triton (autotuned)"
    long = plan_kernels(setting(length=1 << 20, forward="triton", backward="triton"))
    assert str(long) == ("forward=triton (128x64 w8 s3), "
                         "backward=triton-deterministic (128x64 w8 s3 + 64x64 w4 s2)")
    monkeypatch.setattr(tuning, "AUTOTUNE", False)
    assert "autotuned" not in str(plan_kernels(setting(length=4096, forward="triton", backward="triton")))


def test_tma_refusals():
    base = torch.zeros(1, 64, 2, 68, dtype=torch.bfloat16)
    assert "multiple of 16 bytes" in gluon.tma_refusal("q", base[..., :64])
    assert "head-dim stride" in gluon.tma_refusal("k", base.transpose(-1, -2))
    assert "multiple of 16 bytes, as TMA" in gluon.tma_refusal("v", base.flatten()[1:1 + 64 * 2 * 64].view(1, 64, 2, 64))
    fused = torch.zeros(2, 33, (12 + 2 * 4) * 64, dtype=torch.bfloat16)
    q, k, v = (t.unflatten(-1, (-1, 64)) for t in fused.split([12 * 64, 4 * 64, 4 * 64], dim=-1))
    assert all(gluon.tma_refusal(n, t) is None for n, t in zip("qkv", (q, k, v)))
    one = torch.zeros(1, 5, 1, 64, dtype=torch.bfloat16)   # size-1 dims: their stride is never used
    assert gluon.tma_refusal("q", one.as_strided(one.shape, (3, 64, 7, 1))) is None


def test_a_call_signature_is_planned_once(monkeypatch):
    """Host cost: the checks and the plan of a call are looked up, not recomputed, on the next call
    with the same shapes, strides, dtype, device and options."""
    from kernels import flash_op
    calls = []
    real = flash_op._plan_call
    monkeypatch.setattr(flash_op, "_plan_call", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(flash_op, "_CALLS", {})
    q, k, v = (torch.randn(1, 40, 2, 16, device=DEVICE, dtype=torch.float16) for _ in range(3))
    for _ in range(3):
        flash_attention(q, k, v, causal=True)
    flash_attention(q, k, v, causal=False)
    flash_attention(q[:, :39], k, v, causal=True)
    assert len(calls) == 3


# ---- the composition: config -> plan -> model -> the kernels that launch --------------------------

def _kernel_name(obj) -> str:
    return getattr(obj, "__name__", None) or obj.fn.__name__


@pytest.fixture
def launches(monkeypatch):
    """Every kernel of the two families records its launch instead of running it."""
    from triton.runtime.autotuner import Autotuner

    from kernels import flash_bwd, flash_fwd
    from kernels.gluon import backward, forward

    record: list[str] = []
    for module in (flash_fwd, flash_bwd, forward, backward):
        for name, obj in list(vars(module).items()):
            if hasattr(obj, "run") and hasattr(obj, "fn"):   # jitted (or autotuned) kernels
                target = obj.fn if isinstance(obj, Autotuner) else obj
                monkeypatch.setattr(target, "run", lambda *a, _name=_kernel_name(target), **kw: record.append(_name))
    return record


# What each direction of a plan launches, by family and variant.
LAUNCHED = {
    "forward": {"triton": ["flash_fwd_kernel"], "gluon": ["attention_fwd_ws"]},
    "backward": {"triton-deterministic": ["flash_bwd_q_kernel", "flash_bwd_kv_kernel"],
                 "triton-atomic": ["flash_bwd_delta_kernel", "flash_bwd_kv_dq_kernel"],
                 "gluon-deterministic": ["gluon_bwd_prep_kernel", "gluon_bwd_kernel", "gluon_bwd_dq_kernel"],
                 "gluon-atomic": ["gluon_bwd_prep_kernel", "gluon_bwd_kernel", "gluon_bwd_dq_kernel"]},
}


def _expected(plan_text: str, gqa: bool = False) -> tuple[list[str], list[str]]:
    """The kernels a plan launches; the Gluon backward sums GQA's dK/dV shares in one more."""
    forward, backward = re.fullmatch(r"forward=(\S+) \(.*?\), backward=(\S+) \(.*\)", plan_text).groups()
    launched = list(LAUNCHED["backward"][backward])
    if gqa and backward.startswith("gluon"):
        launched.insert(launched.index("gluon_bwd_kernel") + 1, "gluon_bwd_dkdv_kernel")
    return LAUNCHED["forward"][forward.split("-")[0]], launched


def _doc_rows() -> list[tuple[str, str]]:
    """(overrides, plan) from docs/attention.md's table of what `auto` runs on an H200."""
    text = (REPO / "docs" / "attention.md").read_text()
    rows = re.findall(r"^\| `([^`|]+)` \| `(forward=[^`]+)` \|$", text, flags=re.MULTILINE)
    assert len(rows) >= 5, "docs/attention.md lost its table of kernel plans"
    return rows


def _composed(overrides: list[str], monkeypatch):
    from training.builders import resolve_config
    from training.config import compose

    monkeypatch.setattr(kernel_plan, "device_arch", lambda device: "sm_90")   # a Hopper, as far as plans go
    monkeypatch.setattr("kernels.tuning.INTERPRET", False)   # the GPU's tile tables, not the interpreter's
    monkeypatch.setattr("model.attention.INTERPRET", True)   # flash on device=cpu, on a CUDA host too
    cfg = compose(["attention=flash", "device=cpu", "trainer.precision=bf16", "run.dir=unused", *overrides])
    resolve_config(cfg)
    return cfg


@pytest.mark.parametrize("overrides, documented", _doc_rows(), ids=lambda x: x if "=" in x and " " not in x else None)
def test_the_documented_plans_are_what_a_run_records(monkeypatch, overrides, documented):
    assert _composed(overrides.split(), monkeypatch).attention.plan == documented


# A model per head dim, small enough to run on the CPU; the lengths decide the plans.
TINY = {64: ["model=tiny", "model.n_layer=1", "model.d_model=128", "model.n_head=2", "model.n_kv_head=2"],
        128: ["model=tiny", "model.n_layer=1", "model.d_model=256", "model.n_head=2", "model.n_kv_head=1"]}


@pytest.mark.skipif(HAS_CUDA, reason="fakes a Hopper on the CPU")
@pytest.mark.parametrize("words", [["attention.kernel=auto"], ["attention.kernel=triton"], ["attention.kernel=gluon"],
                                   ["attention.forward_kernel=gluon", "attention.backward_kernel=triton"],
                                   ["attention.kernel=gluon", "attention.deterministic=false"],
                                   ["attention.kernel=auto", "model.attention_sinks=true"],
                                   ["attention.kernel=auto", "model.attention_dropout=0.1",
                                    "model.attention_softcap=30"]],
                         ids=lambda w: ",".join(x.split(".")[-1] for x in w))
@pytest.mark.parametrize("head_dim, length", [(64, 256), (64, 16384), (128, 1024)])
def test_the_kernels_that_launch_are_the_plans(monkeypatch, launches, words, head_dim, length):
    """Config -> the recorded plan -> the model -> the kernels launched by its forward and backward."""
    from training.builders import model_from_config

    cfg = _composed([*TINY[head_dim], f"trainer.seq_len={length}", *words], monkeypatch)
    monkeypatch.setattr("kernels.flash_op._CALLS", {})
    model = model_from_config(cfg, vocab_size=64).half()   # float16: what the interpreter's checks let through
    tokens = torch.randint(0, 64, (1, length))
    forward, backward = _expected(cfg.attention.plan, gqa=cfg.model.n_kv_head < cfg.model.n_head)
    out = model(tokens)
    assert launches == forward, (cfg.attention.plan, launches)
    launches.clear()
    out.float().sum().backward()
    assert launches == backward, (cfg.attention.plan, launches)
