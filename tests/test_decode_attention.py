"""kernels/decode.py: the split-over-keys decode attention against float64 attention over the valid keys."""
import pytest
import torch

from kernels import attention_reference
from kernels.decode import SPLIT, decode_reference, flash_decode
from model.attention import DECODE, sdpa_decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # on the CPU: Triton's interpreter


def inputs(batch, n_q, heads, kv_heads, dim, n_keys, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_q, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, n_keys, kv_heads, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, n_keys, kv_heads, dim, generator=g, dtype=torch.float64)
    return q, k, v


def exact(q, k, v, valid, window=None):
    """Causal attention of the last n_q of the first `valid` keys, the rest of the buffer cut off."""
    return attention_reference(q, k[:, :valid], v[:, :valid], causal=True, window=window)


@pytest.mark.parametrize("batch,n_q,heads,kv_heads,dim,n_keys,valid,window", [
    (2, 1, 4, 2, 16, 600, 517, None),         # GQA, valid keys end inside a split, later splits empty
    (1, 3, 4, 4, 32, 300, 300, None),         # three new queries, the buffer full
    (2, 1, 6, 2, 24, 2 * SPLIT + 5, 5, None),  # a padded head dim, almost every split empty
    (1, 2, 4, 1, 16, 700, 650, 100),          # MQA, a sliding window across a split boundary
    (1, 1, 2, 2, 64, 64, 1, None),            # one key
])
def test_flash_decode_matches_float64_attention_over_the_valid_keys(batch, n_q, heads, kv_heads, dim, n_keys,
                                                                      valid, window):
    q, k, v = inputs(batch, n_q, heads, kv_heads, dim, n_keys)
    want = exact(q, k, v, valid, window)
    length = torch.tensor([valid])
    torch.testing.assert_close(decode_reference(q, k, v, length, window=window), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(sdpa_decode(q, k, v, length, window=window), want, rtol=0, atol=1e-12)
    q32, k32, v32 = (t.to(DEVICE, torch.float32) for t in (q, k, v))
    got = flash_decode(q32, k32, v32, length.to(DEVICE), window=window)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=2e-6)


def test_flash_decode_reads_strided_buffers_and_ignores_what_lies_past_the_length():
    q, k, v = inputs(1, 1, 4, 2, 16, 400)
    buffer = torch.randn(1, 400, 2, 2, 16, dtype=torch.float64)   # k, v interleaved: strided views
    buffer[:, :, 0], buffer[:, :, 1] = k, v
    junk = buffer.clone()
    junk[:, 300:] = 1e4          # garbage after the valid keys
    want = exact(q, k, v, 300)
    to = dict(device=DEVICE, dtype=torch.float32)
    for buf in (buffer, junk):
        got = flash_decode(q.to(**to), buf[:, :, 0].to(**to), buf[:, :, 1].to(**to), torch.tensor([300], device=DEVICE))
        torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=2e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on the GPU (the interpreter's bf16 is not the GPU's)")
@pytest.mark.parametrize("n_keys,valid", [(4096 + 64, 4097), (32768 + 64, 30000)])
def test_flash_decode_in_bf16_is_as_close_as_sdpa(n_keys, valid):
    q, k, v = inputs(2, 1, 12, 12, 64, n_keys)
    want = exact(q, k, v, valid)
    length = torch.tensor([valid], device="cuda")
    bf = [t.cuda().bfloat16() for t in (q, k, v)]
    ours = (flash_decode(*bf, length).double().cpu() - want).abs().max()
    sdpa = (sdpa_decode(*bf, length).double().cpu() - want).abs().max()
    assert ours <= 2 * sdpa + 1e-3, (ours, sdpa)


def test_every_registered_attention_has_a_decode_entry():
    from model.attention import ATTENTION
    assert set(DECODE) == set(ATTENTION)


def test_bad_decode_inputs_are_named():
    q, k, v = (t.to(DEVICE, torch.float32) for t in inputs(1, 1, 4, 2, 16, 32))
    with pytest.raises(ValueError, match="cache_len must be an integer tensor"):
        flash_decode(q, k, v, 5)
    with pytest.raises(ValueError, match="cache_len must be an integer tensor"):
        flash_decode(q, k, v, torch.tensor([5.0], device=DEVICE))
    with pytest.raises(ValueError, match="window must be a positive int"):
        flash_decode(q, k, v, torch.tensor([5], device=DEVICE), window=0)
    with pytest.raises(ValueError, match="3 new queries do not fit a cache of 2 keys"):
        flash_decode(q.expand(1, 3, 4, 16), k[:, :2], v[:, :2], torch.tensor([2], device=DEVICE))
