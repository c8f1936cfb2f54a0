"""Ring attention over gloo (2 and 3 CPU processes) against single-process attention.

Each world size is spawned once and runs every case; rank 0 gathers the outputs, lse and
gradients back into whole sequences (through the CP helpers under test) and saves them,
and the test compares them with attention over the whole sequence in one process:
float64 with the plain-PyTorch blocks (equal to rounding), float32 with our Triton kernel
in the interpreter (within float32 error of the float64 answer). The same workers run a
tiny GPT with its attention on the ring: loss and every parameter gradient must equal
the single-process model's in float64. Packed documents and sliding windows run the same
way, on the balanced layout of each batch, against the single process with the same mask
(which differs from the unmasked answer, so the mask is really applied).
"""
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kernels import attention_reference, flash_attention_backward
from kernels.masks import document_bounds, visible_mask
from training.builders import build_model   # the schema's checks, then model.build_model
from model.context_parallel import (context_parallel_batch, context_parallel_positions, document_layout,
                                    gather_from_context_parallel, merge_context_parallel, split_for_context_parallel,
                                    use_context_parallel)
from model.ring_attention import STEP_COUNTS, ring_attention
from tests.spawned import free_port, start_ranks
from training.parallel.distributed import close_distributed

CHUNK, BATCH, HEAD_DIM = 4, 2, 16
# name: (block, dtype, causal, heads, kv heads)
CASES = {
    "causal": ("naive", torch.float64, True, 4, 4),
    "full": ("naive", torch.float64, False, 4, 4),
    "gqa-causal": ("naive", torch.float64, True, 4, 2),
    "gqa-full": ("naive", torch.float64, False, 4, 2),
    "flash-gqa-causal": ("flash", torch.float32, True, 4, 2),   # run with C=2 only (interpreter time)
}
INTERPRETER_CASE_SIZES = (2,)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6}
# Causal masks on longer sequences (24 tokens per rank: the balanced layout cuts them into
# chunks of 3): name: (block, dtype, packed documents, window); GQA 4/2 throughout.
MASK_CASES = {
    "docs": ("naive", torch.float64, True, None),
    "docs-window": ("naive", torch.float64, True, 7),
    "window": ("naive", torch.float64, False, 7),
    "flash-docs-window": ("flash", torch.float32, True, 7),   # C=2 only
}
MASK_TOKENS_PER_RANK = 24


def packed_ids(seq_len: int) -> torch.Tensor:
    """(2, T) sampler-style document ids: a document of one token, short ones, and long ones
    crossing many chunks; the second row packs others."""
    rows = [[5, 1, seq_len // 2 - 6, seq_len - seq_len // 2], [1, seq_len // 3, 3, 2, seq_len - seq_len // 3 - 6]]
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def random_qkv(seed, batch, seq, heads, kv_heads, head_dim):
    """Whole-sequence q, k, v, dout (float64 on the CPU), the same in every process."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, seq, kv_heads, head_dim, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=g, dtype=torch.float64)


def make_inputs(name, size):
    _, _, _, heads, kv_heads = CASES[name]
    return random_qkv(sorted(CASES).index(name) + 10 * size, BATCH, 2 * size * CHUNK, heads, kv_heads, HEAD_DIM)


def ring_pass(inputs, rank, size, dtype, device, **kw):
    """Ring attention forward and backward on this rank's chunks of whole-sequence inputs;
    returns out, lse, dq, dk, dv gathered back into whole sequences (on the CPU)."""
    q, k, v, dout = (split_for_context_parallel(t, rank, size).to(device, dtype) for t in inputs)
    return _ring_grads(q, k, v, dout, None, **kw)


def _ring_grads(q, k, v, dout, layout, **kw):
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ring_attention(q, k, v, return_lse=True, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return {key: gather_from_context_parallel(t.detach(), dim=2 if key == "lse" else 1, layout=layout).cpu()
            for key, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads))}


def make_mask_inputs(name, size):
    """Whole-sequence q, k, v, dout and the document ids (None without documents) of a mask case."""
    inputs = random_qkv(sorted(MASK_CASES).index(name) + 100 * size, BATCH, MASK_TOKENS_PER_RANK * size, 4, 2,
                        HEAD_DIM)
    return inputs, packed_ids(inputs[0].shape[1]) if MASK_CASES[name][2] else None


def masked_ring_pass(name, rank, size):
    """As ring_pass, on the layout context_parallel_batch picks for the case's documents; also
    this call's ring steps by kind."""
    block, dtype, _, window = MASK_CASES[name]
    inputs, ids = make_mask_inputs(name, size)
    _, _, kwargs = context_parallel_batch(inputs[0][..., 0, 0], None, document_ids=ids, window=window)
    layout = document_layout(ids, size, window)[0] if ids is not None else None
    split = (lambda t: layout.split(t, rank)) if layout else (lambda t: split_for_context_parallel(t, rank, size))
    before = Counter(STEP_COUNTS)
    result = _ring_grads(*(split(t).to(dtype) for t in inputs), layout, causal=True, block=block, window=window,
                         document_ids=kwargs.get("document_ids"))
    steps = torch.tensor([STEP_COUNTS[k] - before[k] for k in ("unmasked", "masked", "skipped")])
    dist.all_reduce(steps)
    return {**result, "steps": steps}


def _worker(rank, size, port, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        results = {}
        for name, (block, dtype, causal, _, _) in CASES.items():
            if block != "flash" or size in INTERPRETER_CASE_SIZES:
                results[name] = ring_pass(make_inputs(name, size), rank, size, dtype, "cpu", causal=causal, block=block)
        for name, (block, *_) in MASK_CASES.items():
            if block != "flash" or size in INTERPRETER_CASE_SIZES:
                results[name] = masked_ring_pass(name, rank, size)
        for name in MODEL_CASES:
            if size in COMPILED_CASE_SIZES or not MODEL_CASES[name].get("compile"):
                results[name] = context_parallel_step(name, size)
        if rank == 0:
            torch.save(results, path)
    finally:
        close_distributed()


# name: model config overrides (GQA throughout; RoPE and learned positions; checkpointing;
# "compile": the model under torch.compile, C=2 only, aot_eager: no C++ toolchain needed;
# "documents": packed windows with the document mask, "window": attention.window; a soft cap that
# bends the initial scores, and sinks)
MODEL_CASES = {
    "model-rope": {},
    "model-learned-full-ckpt": {"pos_emb": "learned", "activation_checkpointing": "full"},
    "model-selective-ckpt": {"activation_checkpointing": "selective", "tie_embeddings": False},
    "model-compiled": {"compile": True},
    "model-docs-reset-learned-full-ckpt": {"documents": True, "reset_positions": True, "pos_emb": "learned",
                                           "activation_checkpointing": "full"},
    "model-docs-window-reset-compiled": {"documents": True, "window": 5, "reset_positions": True, "compile": True},
    "model-softcap-sinks": {"attention_softcap": 0.02, "attention_sinks": True},   # the sinks' gradient included
}
COMPILED_CASE_SIZES = (2,)
VOCAB = 64
EXTRA = ("compile", "documents", "window")   # case keys that are not model config


def make_model_inputs(name, size):
    """A float64 tiny GPT (same weights in every process), a batch of whole windows whose
    targets include ignored (-100) tokens, unevenly spread over the CP ranks, and their document
    ids (None without documents)."""
    torch.manual_seed(0)
    case = MODEL_CASES[name]
    overrides = {key: value for key, value in case.items() if key not in EXTRA}
    model = build_model({"n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32, "max_seq_len": 96,
                         **overrides}, VOCAB, "naive", window=case.get("window")).double()
    g = torch.Generator().manual_seed(size)
    seq_len = (MASK_TOKENS_PER_RANK if case.get("documents") else 2 * CHUNK) * size
    idx = torch.randint(0, VOCAB, (BATCH, seq_len), generator=g)
    targets = torch.randint(0, VOCAB, idx.shape, generator=g)
    targets[0, :3] = targets[1, -5:] = -100
    return model, idx, targets, packed_ids(seq_len) if case.get("documents") else None


def context_parallel_step(name, size):
    """One CP forward/backward: each rank's mean loss over its valid tokens, weighted by its
    share of the valid tokens, summed over ranks, as are the parameter gradients."""
    model, idx, targets, ids = make_model_inputs(name, size)
    use_context_parallel(model)
    idx, targets, kwargs = context_parallel_batch(idx, targets, document_ids=ids, window=model.window)
    count = (targets != -100).sum().double()
    total = count.clone()
    dist.all_reduce(total)
    run = torch.compile(model, backend="aot_eager") if MODEL_CASES[name].get("compile") else model
    loss = run(idx, targets, **kwargs) * (count / total)
    loss.backward()
    for t in [loss.detach()] + [p.grad for p in model.parameters()]:
        dist.all_reduce(t)
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}


@pytest.fixture(scope="module", params=[2, 3], ids=["C2", "C3"])
def ring_results(request, tmp_path_factory):
    size = request.param
    path = tmp_path_factory.mktemp(f"ring{size}") / "results.pt"
    start_ranks(_worker, (size, free_port(), str(path)), size, path.parent)
    return size, torch.load(path)


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_ring_equals_single_process_attention(ring_results, name):
    size, results = ring_results
    block, dtype, causal, _, _ = CASES[name]
    if block == "flash" and size not in INTERPRETER_CASE_SIZES:
        pytest.skip("the Triton-interpreter case runs with C=2 only")
    q, k, v, dout = (t.requires_grad_() for t in make_inputs(name, size))
    out, lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    expected = dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *torch.autograd.grad(out, (q, k, v), dout))))
    for key, ref in expected.items():
        got = results[name][key]
        assert got.shape == ref.shape and got.dtype == dtype
        err = rel_err(got, ref.detach())
        assert err < TOLERANCE[dtype], f"{name} C={size} {key}: relative error {err:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", MASK_CASES)
def test_masked_ring_equals_single_process_attention(ring_results, name):
    size, results = ring_results
    block, dtype, _, window = MASK_CASES[name]
    if block == "flash" and size not in INTERPRETER_CASE_SIZES:
        pytest.skip("the Triton-interpreter case runs with C=2 only")
    (q, k, v, dout), ids = make_mask_inputs(name, size)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(q, k, v, causal=True, return_lse=True, document_ids=ids, window=window)
    expected = dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *torch.autograd.grad(out, (q, k, v), dout))))
    unmasked = attention_reference(q, k, v, causal=True)
    assert rel_err(unmasked.detach(), out.detach()) > 0.05, "the case's mask should change the answer"
    for key, ref in expected.items():
        got = results[name][key]
        assert got.shape == ref.shape and got.dtype == dtype
        err = rel_err(got, ref.detach())
        assert err < TOLERANCE[dtype], f"{name} C={size} {key}: relative error {err:.3g}"
    unmasked_steps, masked_steps, skipped = results[name]["steps"].tolist()
    assert unmasked_steps + masked_steps + skipped == size * size and masked_steps >= size   # step 0 is masked


@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_CASES)
def test_context_parallel_model_step_equals_single_process(ring_results, name):
    size, results = ring_results
    if MODEL_CASES[name].get("compile") and size not in COMPILED_CASE_SIZES:
        pytest.skip("the torch.compile case runs with C=2 only")
    model, idx, targets, ids = make_model_inputs(name, size)
    loss = model(idx, targets, **({} if ids is None else {"document_ids": ids}))
    loss.backward()
    expected = {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}
    assert results[name].keys() == expected.keys()
    for key, ref in expected.items():
        err = rel_err(results[name][key], ref)
        assert err < TOLERANCE[torch.float64], f"{name} C={size} {key}: relative error {err:.3g}"
    if ids is not None:   # the control: without the mask the same model computes another loss
        assert abs(model(idx, targets).item() - loss.item()) > 1e-3


def test_split_merge_and_positions_round_trip():
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    for size in (1, 2, 3):
        parts = [split_for_context_parallel(x, r, size) for r in range(size)]
        assert torch.equal(merge_context_parallel(parts), x)
        positions = [context_parallel_positions(24, r, size) for r in range(size)]
        for part, pos in zip(parts, positions):
            assert torch.equal(part, x[:, pos])   # each local token sits at its true position
        assert torch.equal(torch.sort(torch.cat(positions)).values, torch.arange(24))
    assert context_parallel_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert context_parallel_positions(8, 1, 2).tolist() == [2, 3, 4, 5]


def test_explicit_positions_place_the_tokens():
    """positions=0..T-1 is the default; RoPE only sees differences of positions (a shift
    changes nothing but rounding, other gaps do); learned embeddings are looked up at the positions given,
    per sequence with (B, T) positions."""
    torch.manual_seed(0)
    idx = torch.randint(0, VOCAB, (2, 12))
    rope = build_model({"n_layer": 1, "max_seq_len": 16}, VOCAB, "naive").double()
    logits = rope(idx)
    assert torch.equal(rope(idx, positions=torch.arange(12)), logits)
    # the cos/sin table is float32: a shift moves the logits by rounding only
    assert (rope(idx, positions=torch.arange(12) + 3) - logits).abs().max() < 1e-7
    assert (rope(idx, positions=2 * torch.arange(12)) - logits).abs().max() > 1e-3
    learned = build_model({"n_layer": 1, "max_seq_len": 16, "pos_emb": "learned"}, VOCAB, "naive").double()
    shifted = torch.stack([torch.arange(12), torch.arange(12) + 3])
    got = learned(idx, positions=shifted)
    assert torch.equal(got[:1], learned(idx[:1]))
    with torch.no_grad():
        learned.pos_emb.weight[:13] = learned.pos_emb.weight[3:].clone()
    assert torch.equal(got[1:], learned(idx[1:]))


@pytest.mark.parametrize("call, message", [
    (lambda: build_model({"n_layer": 1}, VOCAB, "naive")(torch.zeros(1, 6, dtype=torch.long),
                                                        positions=torch.arange(5)), "positions of shape \\(5,\\)"),
    (lambda: split_for_context_parallel(torch.zeros(1, 10, 2), 0, 3), "not divisible by 2 x context-parallel size = 6"),
    (lambda: context_parallel_positions(12, 3, 3), "rank 3 is outside 0..2"),
    (lambda: context_parallel_positions(12, 0, 0), "must be a positive integer"),
    (lambda: ring_attention(*[torch.zeros(1, 6, 2, 8)] * 3, block="sdpa"), "block 'sdpa' is not one of"),
    (lambda: ring_attention(*[torch.zeros(1, 5, 2, 8)] * 3), "local sequence length 5 is odd"),
    (lambda: ring_attention(torch.zeros(1, 6, 3, 8), *[torch.zeros(1, 6, 2, 8)] * 2), "not a multiple"),
    (lambda: ring_attention(torch.zeros(1, 6, 2, 8), *[torch.zeros(1, 4, 2, 8)] * 2), "self-attention"),
    (lambda: ring_attention(*[torch.zeros(1, 6, 2, 8)] * 3), "needs torch.distributed initialised"),
    (lambda: use_context_parallel(build_model({"n_layer": 1}, VOCAB, "sdpa")), "needs attention=flash or naive"),
    (lambda: flash_attention_backward(*[torch.zeros(1, 6, 2, 16)] * 5, torch.zeros(1, 2, 6, dtype=torch.float64)),
     "lse must be a float32 tensor of shape"),
    (lambda: flash_attention_backward(*[torch.zeros(1, 6, 2, 16)] * 4, torch.zeros(1, 5, 2, 16), torch.zeros(1, 2, 6)),
     "out must be a torch.float32 tensor of q's shape"),
])
def test_bad_input_is_one_line_value_error(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


GPU_SHAPE = (1, 8192, 8, 2, 64)   # batch, whole sequence, heads, KV heads, head dim


def _gpu_worker(rank, size, port, path):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        results = {causal: ring_pass(random_qkv(7, *GPU_SHAPE), rank, size, torch.bfloat16, f"cuda:{rank}",
                                     causal=causal, block="flash") for causal in (True, False)}
        if rank == 0:
            torch.save(results, path)
    finally:
        close_distributed()


def attention_and_grads(inputs, dtype, causal):
    q, k, v, dout = (t.to("cuda", dtype) for t in inputs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return {key: t.detach().cpu() for key, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads))}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ring_on_two_gpus_nccl_bf16(tmp_path):
    """NCCL and our kernel in bf16 at 8K tokens (chunks of 2K): at most 2x as far from the
    float64 answer as the plain formula evaluated in bf16 on one GPU."""
    path = tmp_path / "results.pt"
    start_ranks(_gpu_worker, (2, free_port(), str(path)), 2, tmp_path)
    results, inputs = torch.load(path), random_qkv(7, *GPU_SHAPE)
    for causal, got in results.items():
        exact = attention_and_grads(inputs, torch.float64, causal)
        plain = attention_and_grads(inputs, torch.bfloat16, causal)
        for key, ref in exact.items():
            err, bound = rel_err(got[key], ref), 2 * rel_err(plain[key], ref)
            assert err <= bound, f"causal={causal} {key}: relative error {err:.3g} > {bound:.3g}"


def test_kernels_stay_free_of_torch_distributed():
    """The ring lives in model/; kernels/ is single-device code and must stay importable alone."""
    kernel_dir = Path(__file__).resolve().parent.parent / "kernels"
    users = [p.name for p in kernel_dir.glob("*.py") if "torch.distributed" in p.read_text()]
    assert not users, f"kernels/ files using torch.distributed: {users}"


# ----------------------------------------------------------------------------- layouts and steps, one process

def test_balanced_layout_evens_out_the_documents_and_round_trips():
    from model.cp_layout import balanced_layout, imbalance, rank_work, visible_keys, zigzag_layout

    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([70, 6, 10, 10]))[None]   # one long, three short
    starts = document_bounds(ids)[:, 0].long()
    work = visible_keys(starts, 96, None)
    assert work.sum() == visible_mask(96, 96, True, ids).sum()
    zigzag, balanced = zigzag_layout(96, 2), balanced_layout(work, 2)
    assert balanced == balanced_layout(work.clone(), 2), "every rank must compute the same layout"
    assert imbalance(balanced, work) < 1.05 < imbalance(zigzag, work)
    assert sum(rank_work(balanced, work)) == work.sum()
    x = torch.arange(2 * 96).view(2, 96)
    parts = [balanced.split(x, r) for r in range(2)]
    assert torch.equal(balanced.merge(parts), x)
    for r, part in enumerate(parts):
        assert torch.equal(part, x[:, balanced.positions(r)]) and bool((balanced.positions(r).diff() > 0).all())
    # one document over the whole window: zig-zag is already even, and kept
    assert balanced_layout(visible_keys(None, 96, None), 2) == zigzag


def test_masked_steps_skip_chunks_nobody_sees_and_trim_the_rest():
    from model.cp_layout import zigzag_layout
    from model.ring_attention import masked_steps

    layout = zigzag_layout(16, 2)                       # rank 0: tokens 0-3, 12-15; rank 1: 4-11
    in_chunks = document_bounds(torch.arange(4).repeat_interleave(4)[None])[:, 0].long()
    for rank in (0, 1):                                 # documents = chunks: only own K/V is seen
        steps = masked_steps(layout, rank, in_chunks, None, "cpu")
        assert steps[0].rows == slice(0, 8) and steps[0].key_bounds is not None and steps[1] is None
    # a window of 2, no documents: rank 0's token 12 sees token 11 of rank 1, nothing else does
    step = masked_steps(layout, 0, None, 2, "cpu")[1]
    assert (step.rows, step.cols, step.key_bounds) == (slice(4, 5), slice(7, 8), None)   # one pair: unmasked
    # one document from token 2 on: rank 1's queries see rank 0's tokens 2-3, every one of them
    step = masked_steps(layout, 1, document_bounds(torch.tensor([[0, 0] + [1] * 14]))[:, 0].long(), None, "cpu")[1]
    assert (step.rows, step.cols, step.key_bounds) == (slice(0, 8), slice(2, 4), None)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    close_distributed()


def test_ring_of_one_with_documents_and_its_refusals(one_rank_group):
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([3, 9, 4]))[None].expand(2, -1)
    q, k, v, _ = random_qkv(3, 2, 16, 4, 2, 8)
    _, _, kwargs = context_parallel_batch(q[..., 0, 0], None, document_ids=ids, window=5)
    out = ring_attention(q, k, v, causal=True, block="naive", document_ids=kwargs["document_ids"], window=5)
    torch.testing.assert_close(out, attention_reference(q, k, v, causal=True, document_ids=ids, window=5),
                               rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="document_ids must be the local ids model.context_parallel"):
        ring_attention(q, k, v, causal=True, block="naive", document_ids=ids.clone())
    with pytest.raises(ValueError, match="made for window=5 on rank 0 of 1, not window=None"):
        ring_attention(q, k, v, causal=True, block="naive", document_ids=kwargs["document_ids"])
    with pytest.raises(ValueError, match="document_ids and window need causal=True"):
        ring_attention(q, k, v, block="naive", window=3)
