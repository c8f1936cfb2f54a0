"""kernels/rotary.py: rotary embedding of a fused QKV projection in one kernel each way, against
model/rope.py's tensor operations (CPU: Triton's interpreter; CUDA: bf16)."""
import pytest
import torch

from conftest import HAS_CUDA
from kernels.rotary import rotary_qkv
from model.rope import apply_rope, rope_table

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if HAS_CUDA else [torch.float32, torch.float16]


def reference(qkv, cos, sin, n_head, n_kv_head, head_dim):
    """apply_rope on q and k, v as it is, joined again."""
    q, k, v = qkv.split([n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim], dim=-1)
    q, k = (apply_rope(t.unflatten(-1, (-1, head_dim)), cos, sin).flatten(-2) for t in (q, k))
    return torch.cat((q, k, v), dim=-1)


def inputs(B, T, H, Hkv, D, dtype, per_sequence=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 5000, (B, T) if per_sequence else (T,), generator=g).to(DEVICE)
    cos, sin = rope_table(positions, D, 10000.0)
    return qkv, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 19, 4, 2, 32), (1, 8, 3, 3, 6)], ids=["gqa", "odd-half"])
@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared-table", "per-sequence"])
def test_forward_and_backward_match_the_tensor_operations(dtype, shape, per_sequence):
    B, T, H, Hkv, D = shape
    qkv, cos, sin = inputs(B, T, H, Hkv, D, dtype, per_sequence)
    dy = torch.randn_like(qkv)
    ours_in, ref_in = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    ours = rotary_qkv(ours_in, cos, sin, H + Hkv, D)
    ref = reference(ref_in, cos, sin, H, Hkv, D)
    (d_ours,), (d_ref,) = torch.autograd.grad(ours, ours_in, dy), torch.autograd.grad(ref, ref_in, dy)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else {}   # 16-bit: one rounding each, maybe apart
    torch.testing.assert_close(ours, ref, **tol)
    torch.testing.assert_close(d_ours, d_ref, **tol)
    v = slice((H + Hkv) * D, None)
    assert torch.equal(ours[..., v], qkv[..., v]) and torch.equal(d_ours[..., v], dy[..., v])   # v copied
    assert not torch.equal(ours[..., : H * D], qkv[..., : H * D])


def test_backward_turns_back_by_the_same_angle():
    """The rotation is orthogonal: the backward of the forward's output is the input (float32)."""
    qkv, cos, sin = inputs(2, 11, 2, 1, 16, torch.float32)
    from kernels.rotary import _rotate
    back = _rotate(rotary_qkv(qkv, cos, sin, 3, 16), cos, sin, 3, 16, inverse=True)
    torch.testing.assert_close(back, qkv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, match", [
    (dict(head_dim=5), "heads of 5"),
    (dict(rotated_heads=9), "9 of them rotated"),
    (dict(table=(3, 8)), "tables of shape"),
])
def test_bad_arguments_are_one_line_errors(change, match):
    qkv, cos, sin = inputs(1, 4, 2, 1, 16, DTYPES[0])
    if "table" in change:
        cos = sin = torch.zeros(change["table"], device=DEVICE)
    with pytest.raises(ValueError, match=match):
        rotary_qkv(qkv, cos, sin, change.get("rotated_heads", 3), change.get("head_dim", 16))
