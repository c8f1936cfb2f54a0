"""scripts/kernel_dev/backward_error.py's trained-model path: it records what each layer's attention
really saw (q, k, v, masks, the output's gradient) and sums a region's error over documents and
head groups as if measured in one piece."""
import pytest
import torch

import backward_error as be
from training.builders import build_model

TINY = dict(name="t", n_layer=2, n_head=4, n_kv_head=2, d_model=32, vocab_size=None, max_seq_len=64)


def test_documents_are_the_runs_of_equal_ids():
    ids = torch.tensor([[0, 0, 0, 1, 2, 2]])
    assert be.documents(ids, 6) == [(0, 3), (3, 4), (4, 6)]
    assert be.documents(None, 6) == [(0, 6)]


def test_each_layer_records_its_inputs_and_the_gradient_of_its_output():
    torch.manual_seed(0)
    model = build_model(TINY, vocab_size=50, attention="naive")
    inner = [block.attn.attention for block in model.blocks]
    seen = []   # proj's input is the attention output, flattened: its gradient is dO, found another way

    def keep(_, args):
        args[0].retain_grad()
        seen.append(args[0])

    for block in model.blocks:
        block.attn.proj.register_forward_pre_hook(keep)
    x = torch.randint(0, 50, (1, 12))
    ids = torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32)
    calls = be.recorded_attention(model, x, torch.roll(x, -1, 1), ids, "fp32")

    assert [block.attn.attention for block in model.blocks] == inner   # put back
    for call, y, attention in zip(calls, seen, inner):
        assert call["q"].shape == (1, 12, 4, 8) and call["k"].shape == (1, 12, 2, 8)
        assert torch.equal(call["kw"]["document_ids"], ids) and call["kw"]["causal"] is True
        torch.testing.assert_close(call["do"].flatten(2), y.grad, rtol=0, atol=0)
        assert call["do"].abs().sum() > 0
        out = attention(call["q"], call["k"], call["v"], **call["kw"])   # the inputs give the layer's output
        torch.testing.assert_close(out.flatten(2), y.detach())


def test_a_region_summed_over_documents_and_head_groups_is_the_region_measured_whole():
    """The 16K window's 'first FAR keys' row of the random-input path, at a size the interpreter
    runs: the trained path's far region of the longest document must give the same numbers, with
    the reference cut into one KV head at a time or not cut at all."""
    docs, heads = [16, 64, 40], 2
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, sum(docs), heads, 64, generator=g) for _ in range(4))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(docs))[None].to(torch.int32)
    call = dict(q=q, k=k, v=v, do=do, kw=dict(causal=True, document_ids=ids))
    cut, whole = (be.measure_trained([call], torch.device("cpu"), budget=b) for b in (64 * 64, 2**30))
    assert [r["region"] for r in cut] == [r["region"] for r in whole]
    for a, b in zip(cut, whole):
        assert a["rel_err"] == pytest.approx(b["rel_err"], rel=1e-9) and a["gain"] == pytest.approx(b["gain"], abs=1e-12)
        assert a["repeat_identical"] and a["rel_err"] < 1e-5   # float32 in the interpreter

    start = docs[0]   # the longest document, its first FAR keys, measured directly
    part = [t[:, start:start + docs[1]] for t in (q, k, v, do)]
    exact = be.grads(be.attention_reference, *(t.double() for t in part), causal=True)
    plain = be.grads(be.attention_reference, *part, causal=True)
    mine = be.grads(be.flash_attention, q, k, v, do, causal=True, document_ids=ids, kernel=("triton", "triton"))
    far = slice(0, min(be.FAR, docs[1]))
    for grad in ("dk", "dv"):
        expected = be.stats(be.sums(mine[grad][:, start:start + docs[1]][:, far], plain[grad][:, far], exact[grad][:, far]))
        row = next(r for r in whole if r["grad"] == grad and r["region"].startswith("first"))
        assert row["rel_err"] == pytest.approx(expected["rel_err"], rel=1e-9)
        assert row["region"] == f"first {docs[1]} keys of its longest document ({docs[1]} tokens)"
