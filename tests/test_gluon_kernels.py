"""The Gluon (Hopper) forward against the float64 reference, and the kernel switch's refusals.

On an sm_90 GPU: the Gluon forward (kernels/gluon/forward.py) and every rung of its ladder
(kernels/lab/gluon_forward_ladder.py) in bf16 and fp16 within 2x the plain
formula's error (test_flash_attention's bound and helpers), on poisoned memory, over the shapes
the path covers (odd lengths, GQA, Nq != Nk, causal and not, fused-QKV strides); through
flash_attention, kernel="gluon" (the Gluon forward and backward) and kernel="auto" (the Gluon
forward where chosen, the Triton backward), repeated runs bit-identical, torch.compile(fullgraph=True).
The Gluon backward's own variants and shapes are tests/test_gluon_backward.py's.
Which kernels a call runs, and the refusals of kernel="gluon", are tests/test_kernel_plan.py's (on
the CPU); that the kernels compile for sm_90a on a CPU machine is tests/test_kernel_compile.py's.
"""
import functools

import pytest
import torch

from conftest import requires_hopper
from kernels import attention_reference, flash_attention, gluon
from kernels.gluon import forward as gluon_fwd
from kernels.lab.gluon_forward_ladder import LADDER, variant_launch
from test_flash_attention import (DEVICE, GPU_SHAPES, NAMES, assert_as_exact_as_plain,  # noqa: F401
                                  assert_compiled_matches_eager, forward_backward, make_inputs,
                                  poison_uninitialised_memory)


# The Triton kernel's GPU shapes at the head dims this kernel covers (B, n_q, n_k, H, H_kv, D): a single
# row, ragged tiles, GQA 2/8, MQA, Nq < Nk, Nq > Nk (causal rows that see no key), many programs per head
SHAPES = [s for s in GPU_SHAPES if s[-1] in gluon.HEAD_DIMS]
shape_ids = functools.partial(str.format, "B{}_q{}_k{}_H{}_kv{}_D{}")


def forward_only(variant, q, k, v, causal):
    launch = variant_launch(variant or gluon_fwd.DEFAULT_VARIANTS[q.shape[-1]], causal, q.shape[-1])
    return gluon_fwd.gluon_attention_forward(q, k, v, causal, q.shape[-1] ** -0.5, launch=launch)


def check_forward(variant, q, k, v, causal):
    out, lse = forward_only(variant, q, k, v, causal)
    plain = attention_reference(q, k, v, causal=causal, return_lse=True)
    exact = attention_reference(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
    for name, mine, p, ref in zip(("out", "lse"), (out, lse), plain, exact):
        assert_as_exact_as_plain(name, mine, p, ref, None, v)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: shape_ids(*s))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forward_matches_float64_reference(dtype, shape, causal):
    """The variants flash_attention runs (one per head dim), on every shape, both dtypes, causal and not."""
    check_forward(None, *make_inputs(*shape, dtype)[:3], causal)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES[2:7], ids=lambda s: shape_ids(*s))
@pytest.mark.parametrize("variant", [v for v in LADDER if v not in gluon_fwd.DEFAULT_VARIANTS.values()])
def test_every_variant_matches_float64_reference(variant, shape, causal):
    """The other rungs of the ladder stay correct too (bf16, fewer shapes)."""
    check_forward(variant, *make_inputs(*shape, torch.bfloat16)[:3], causal)


both_gluon = functools.partial(flash_attention, kernel="gluon")


@requires_hopper
@pytest.mark.parametrize("kernel", ["gluon", "auto"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES[1:6], ids=lambda s: shape_ids(*s))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forward_backward_matches_float64_reference(dtype, shape, causal, kernel):
    """Through flash_attention: kernel="gluon" (the Gluon forward and backward) and kernel="auto"
    (what the kernel plan picks for the shape)."""
    q, k, v, do = make_inputs(*shape, dtype)
    ours = forward_backward(functools.partial(flash_attention, kernel=kernel), q, k, v, do, causal)
    plain = forward_backward(attention_reference, q, k, v, do, causal)
    exact = forward_backward(attention_reference, *(t.double() for t in (q, k, v, do)), causal)
    for name, mine, p, ref in zip(NAMES, ours, plain, exact):
        assert_as_exact_as_plain(name, mine, p, ref, do, v)


@requires_hopper
@pytest.mark.parametrize("D", gluon.HEAD_DIMS)
def test_later_calls_of_a_signature_are_exact_on_their_own_inputs(D):
    """Later calls of a signature launch directly with TMA descriptors copied from the first call's
    and rebased on their own tensors (kernels/gluon/__init__.py `descriptors`): each of three calls on
    fresh inputs must match the reference on those inputs."""
    for _ in range(3):
        q, k, v, do = make_inputs(2, 300, 300, 4, 2, D, torch.bfloat16)
        ours = forward_backward(both_gluon, q, k, v, do, True)
        plain = forward_backward(attention_reference, q, k, v, do, True)
        exact = forward_backward(attention_reference, *(t.double() for t in (q, k, v, do)), True)
        for name, mine, p, ref in zip(NAMES, ours, plain, exact):
            assert_as_exact_as_plain(name, mine, p, ref, do, v)


def fused_qkv(B, N, H, H_kv, D, dtype):
    """q, k, v as the model passes them: strided views of one (B, N, (H + 2 H_kv) D) projection."""
    qkv = torch.randn(B, N, (H + 2 * H_kv) * D, device="cuda").to(dtype)
    return [t.unflatten(-1, (-1, D)) for t in qkv.split([H * D, H_kv * D, H_kv * D], dim=-1)]


@requires_hopper
@pytest.mark.parametrize("variant", [None, "ws-pingpong"])
@pytest.mark.parametrize("D", [64, 128])
def test_strided_views(variant, D):
    """A fused QKV projection's views, and (B, H, N, D) storage seen through a transpose, read in place."""
    q, k, v = fused_qkv(2, 333, 12, 4, D, torch.bfloat16)
    assert not q.is_contiguous() and not any(gluon.tma_refusal(n, t) for n, t in zip("qkv", (q, k, v)))
    check_forward(variant, q, k, v, True)
    q, k, v = (torch.randn(2, 4, 200, D, device="cuda").to(torch.bfloat16).transpose(1, 2) for _ in range(3))
    check_forward(variant, q, k, v, False)


@requires_hopper
@pytest.mark.parametrize("variant", [None] + list(LADDER))
def test_repeated_runs_are_bit_identical(variant):
    q, k, v, _ = make_inputs(2, 1000, 1000, 8, 2, 128, torch.bfloat16)
    first = forward_only(variant, q, k, v, True)
    for _ in range(2):
        again = forward_only(variant, q, k, v, True)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), "results differ between identical runs"


@requires_hopper
def test_agrees_with_the_triton_forward():
    """Two implementations of one algorithm: close to each other as well as to float64."""
    q, k, v, _ = make_inputs(2, 1000, 1000, 8, 2, 128, torch.bfloat16)
    mine = flash_attention(q, k, v, causal=True, return_lse=True, kernel="gluon")
    theirs = flash_attention(q, k, v, causal=True, return_lse=True, kernel="triton")
    torch.testing.assert_close(mine[0], theirs[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(mine[1], theirs[1], atol=1e-4, rtol=1e-4)


@requires_hopper
def test_custom_op_passes_opcheck():
    q, k, v, _ = make_inputs(1, 130, 130, 2, 1, 64, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for backward in ("triton", "gluon"):
        torch.library.opcheck(torch.ops.flashtrain.gluon_attn_fwd.default, (q, k, v, True, 0.125, None, 0, True, backward),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True, kernel="gluon")
    torch.library.opcheck(torch.ops.flashtrain.gluon_attn_bwd.default,
                          (torch.randn_like(out), q, k, v, out.detach(), lse.detach(), True, 0.125, None, 0, True),
                          test_utils=("test_schema", "test_faketensor"))


@requires_hopper
def test_torch_compile_fullgraph_matches_eager():
    """The custom op traces (fullgraph) and runs the same kernels: the same bits, forward and backward."""
    q, k, v, do = make_inputs(2, 512, 512, 8, 2, 64, torch.bfloat16)
    assert_compiled_matches_eager(lambda q, k, v: both_gluon(q, k, v, causal=True) * 2, q, k, v, do)


@requires_hopper
@pytest.mark.parametrize("make, match", [
    (lambda: [torch.randn(1, 64, 2, 68, device="cuda", dtype=torch.bfloat16)[..., :64] for _ in range(3)],
     "multiple of 16 bytes"),
    (lambda: [torch.randn(1, 64, 2, 96, device="cuda", dtype=torch.bfloat16) for _ in range(3)], "head dims 64, 128"),
    (lambda: [torch.randn(1, 64, 2, 64, device="cuda") for _ in range(3)], "float16 and bfloat16"),
])
def test_gluon_refuses_what_it_cannot_run(make, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(*make(), kernel="gluon")
