"""trainer.context_parallel on the CPU (gloo): the training step of C = 2 and C = 3 ranks (and
DP 2 x CP 2 on 4) against the single-process step in float64, train.py under torchrun against
one process (losses, validation loss, checkpoints both ways), and the refused combinations.

The step cases use targets with -100 spread unevenly over the ranks, gradient accumulation,
checkpointing with chunked loss, FSDP2 and torch.compile (aot_eager, against the eager single
process), and packed documents (the document mask, per-document positions, a sliding window):
the loss, every parameter gradient of both optimizer steps and the final weights and AdamW
moments must equal the single process's (with the same mask) to rounding. train.py runs on a
corpus of short documents with the mask, per-document positions and a window.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from tests.spawned import LISTS_THREADS, free_port, gloo_threads, start_ranks
from tests.test_distributed import assert_losses_close, assert_states_close, torchrun
from tests.trainrun import REPO, cache_dir, losses, run_in_process, subprocess_env, tiny_overrides  # noqa: F401
from training.run.store import load_checkpoint

SEQ, BATCH, ACCUM, VOCAB = 24, 2, 2, 64   # 24 tokens: chunks of 6 with C = 2, of 4 with C = 3
BASE = ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.n_kv_head=2", f"model.vocab_size={VOCAB}",
        f"trainer.batch_size={BATCH}", f"trainer.grad_accum={ACCUM}", f"trainer.seq_len={SEQ}",
        "trainer.precision=fp32", "optim.warmup_steps=0", "optim.grad_clip=0.05", "device=cpu", "attention=naive"]
DOCS = ["data.document_mask=true"]   # the micro-batches then carry document ids
# name: (world size, context_parallel, extra overrides)
STEP_CASES = {
    "C2": (2, 2, []),
    "C2-ckpt-chunked-loss": (2, 2, ["model.activation_checkpointing=full", "model.loss_chunk_size=10"]),
    "C2-fsdp": (2, 2, ["trainer.parallel=fsdp"]),
    "C2-compiled-selective-ckpt": (2, 2, ["trainer.compile=true", "model.activation_checkpointing=selective"]),
    "C3": (3, 3, ["model.pos_emb=learned", f"model.max_seq_len={SEQ}"]),
    "DP2xC2": (4, 2, []),
    "C2-docs-reset-window-compiled": (2, 2, [*DOCS, "model.reset_positions=true", "attention.window=5",
                                             "trainer.compile=true"]),
    "C2-docs-fsdp-full-ckpt": (2, 2, [*DOCS, "trainer.parallel=fsdp", "model.activation_checkpointing=full"]),
    "C3-docs-reset-learned": (3, 3, [*DOCS, "model.reset_positions=true", "model.pos_emb=learned",
                                     f"model.max_seq_len={SEQ}"]),
    "DP2xC2-docs-window": (4, 2, [*DOCS, "attention.window=7"]),
    # the scale's keys-seen count from the document starts a rank is handed, not its own positions
    "C2-docs-length-scale-window": (2, 2, [*DOCS, "model.attention_length_scale=16", "attention.window=6"]),
}


def micro_batches(step: int, documents: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """The global batch of one optimizer step; ignored targets fall mostly on early tokens. With
    documents, sampler-style ids of short documents (each token ends one with probability 0.15)."""
    g = torch.Generator().manual_seed(200 + step)
    batches = []
    for i in range(ACCUM):
        x, y = (torch.randint(VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
        y[0, : 5 + 3 * i] = -100
        y[1, -2:] = -100
        starts = torch.rand(BATCH, SEQ, generator=g) < 0.15
        batches.append((x, y, torch.cumsum(starts, 1) - starts.long()) if documents else (x, y))
    return batches


def run_steps(extra: list[str], env=None) -> dict:
    """Two optimizer steps of a float64 tiny GPT through TrainStep: the loss (mean over ranks),
    the gradients the optimizer saw (after clipping) and the final full state."""
    import torch.distributed as dist

    from training.config import compose
    from training.builders import model_from_config
    from training.loop.step import TrainStep
    from training.parallel.plan import ParallelPlan

    cfg = compose(BASE + extra)
    torch.manual_seed(0)
    model = model_from_config(cfg, VOCAB, attention="naive").double()
    compile_ = torch.compile  # aot_eager: the graphs and graph breaks of torch.compile, no C++ build
    torch.compile = functools.partial(compile_, backend="aot_eager")
    try:
        step = TrainStep(model, cfg, torch.device("cpu"), ParallelPlan(env, cfg.trainer.parallel))
    finally:
        torch.compile = compile_
    assert isinstance(step.forward, torch._dynamo.eval_frame.OptimizedModule) == cfg.trainer.compile
    grads = []
    step.optimizer.register_step_pre_hook(lambda *_: grads.append(
        {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
         for n, p in model.named_parameters()}))
    dp, dp_rank = (env.dp_size, env.dp_rank) if env else (1, 0)
    result = {"loss": [], "grad_norm": []}
    for s in range(2):
        it = iter(micro_batches(s, cfg.data.document_mask)[dp_rank::dp])
        loss, norm = step(lambda: next(it))
        if env:
            dist.all_reduce(loss)
            loss /= env.world_size
        result["loss"].append(loss)
        result["grad_norm"].append(norm)
    result["grads"], result["state"] = grads, step.full_state()
    return result


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from training.parallel.distributed import close_distributed, init_distributed

    try:
        for name, (case_world, size, extra) in STEP_CASES.items():
            if case_world == world:
                env = init_distributed("cpu", timeout_s=60, context_parallel=size)
                result = run_steps(extra + [f"trainer.context_parallel={size}"], env)
                if rank == 0:
                    torch.save(result, f"{out}/{name}.pt")
    finally:
        env = None  # its groups: let go of them, as train.py lets go of its trainer
        close_distributed()
    Path(out, f"threads-{world}-{rank}.txt").write_text(" ".join(gloo_threads()))


@pytest.fixture(scope="module")
def step_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp-steps")
    for world in sorted({w for w, _, _ in STEP_CASES.values()}):  # fork: 2.5x quicker to start than spawn
        start_ranks(_worker, (world, free_port(), str(out)), world, out / f"world{world}", start_method="fork")
    results = {name: torch.load(out / f"{name}.pt", weights_only=True) for name in STEP_CASES}
    results["threads after close"] = {p.stem: p.read_text().split() for p in sorted(out.glob("threads-*.txt"))}
    return results


@pytest.mark.skipif(not LISTS_THREADS, reason="lists threads through Linux's /proc")
def test_leaving_the_group_after_a_context_parallel_mesh_ends_the_gloo_threads(step_results):
    """close_distributed after the (dp, cp) meshes: no gloo or TCPStore thread is left running."""
    threads = step_results["threads after close"]
    assert len(threads) == sum({w for w, _, _ in STEP_CASES.values()})
    assert threads == {rank: [] for rank in threads}


@pytest.mark.parametrize("name", STEP_CASES)
def test_context_parallel_step_equals_the_single_process_step(step_results, name):
    extra = [o for o in STEP_CASES[name][2] if not o.startswith(("trainer.parallel", "trainer.compile"))]
    single, got = run_steps(extra), step_results[name]
    for key, rel in (("loss", 1e-6), ("grad_norm", 1e-12)):  # TrainStep accumulates the loss in float32
        for a, b in zip(got[key], single[key]):
            assert torch.isfinite(b) and a.item() == pytest.approx(b.item(), rel=rel), (key, a, b)
    assert len(got["grads"]) == len(single["grads"]) == 2
    for step_grads, ref_grads in zip(got["grads"], single["grads"]):
        assert step_grads.keys() == ref_grads.keys()
        for k, ref in ref_grads.items():
            assert ref.abs().max() > 0, k  # every parameter takes part
            torch.testing.assert_close(step_grads[k], ref, rtol=1e-12, atol=1e-15, msg=k)
    assert_states_close(got["state"], single["state"])
    if "data.document_mask=true" in extra:   # the control: the same batches without the mask train otherwise
        plain = run_steps([o for o in extra if o not in DOCS and not o.startswith("model.reset_positions")])
        flat = [torch.cat([g.flatten() for g in r["grads"][0].values()]) for r in (plain, single)]
        assert (flat[0] - flat[1]).norm() > 0.05 * flat[1].norm()


def test_summed_loss_over_chunks_equals_the_mean_times_the_count():
    """reduction="sum" is the mean times the number of counted targets, loss and gradients.

    16 of the 24 targets count (8 are ignored), a power of two: dividing by 16 is exact in binary
    floating point, and every operation of the backward is linear in its incoming gradient, so the
    sum's gradient is 16 times the mean's bit for bit. (With a count such as 19, 1/19 is rounded
    and each gradient element carries its own last-bit rounding: no exact statement is possible.)
    Counting the ignored targets too would give a factor of 24."""
    from training.builders import build_model   # the schema's checks, then model.build_model

    torch.manual_seed(0)
    idx, targets = torch.randint(VOCAB, (2, 12)), torch.randint(VOCAB, (2, 12))
    targets[0, :8] = -100
    for chunk in (0, 5):
        model = build_model({"n_layer": 1, "loss_chunk_size": chunk}, VOCAB, "naive").double()
        mean, total = model(idx, targets), model(idx, targets, reduction="sum")
        assert total.item() == mean.item() * 16
        grad_mean = torch.autograd.grad(mean, model.tok_emb.weight)[0]
        grad_sum = torch.autograd.grad(model(idx, targets, reduction="sum"), model.tok_emb.weight)[0]
        assert grad_sum.abs().max() > 0
        torch.testing.assert_close(grad_sum, grad_mean * 16, rtol=0, atol=0)


# ----------------------------------------------------------------------------- train.py under torchrun

STEPS = 8


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A corpus of 4,000 documents of 4-60 bytes (byte tokens): every 64-token window packs several."""
    import json
    import random

    rng = random.Random(0)
    path = tmp_path_factory.mktemp("short-docs") / "docs.jsonl"
    words = ["the", "ring", "passes", "keys", "values", "around", "a", "document", "mask", "window", "of", "tokens"]
    with path.open("w") as f:
        for _ in range(4000):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))[: rng.randint(4, 60)]
            f.write(json.dumps({"text": text}) + "\n")
    return path


def cp_overrides(run_dir, cache, corpus, **extra) -> list[str]:
    """Context parallelism's hardest case for train.py: packed short documents under the document
    mask, positions restarting at each document, a sliding window of 16 of the 64 tokens."""
    return tiny_overrides(run_dir, cache, STEPS, **{
        "attention": "naive", "trainer.eval_every": 4, "trainer.keep_ckpts": 4, "trainer.grad_accum": 2,
        "data": "files", "data.paths": f"[{corpus}]", "data.max_bytes": None, "data.document_mask": "true",
        "model.reset_positions": "true", "attention.window": 16, **extra})


def assert_trains_alike(a: list[tuple], b: list[tuple]) -> None:
    """test_distributed's loss comparison, and the gradient norms to float32 rounding."""
    assert_losses_close(a, b)
    for ra, rb in zip(a, b):
        assert ra[5] == pytest.approx(rb[5], rel=1e-4), (ra, rb)


@pytest.fixture(scope="module")
def single_cp_reference(tmp_path_factory, cache_dir, short_documents):
    run_dir = tmp_path_factory.mktemp("single")
    assert run_in_process(cp_overrides(run_dir, cache_dir, short_documents)) == 0
    return run_dir


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory, cache_dir, short_documents):
    run_dir = tmp_path_factory.mktemp("cp")
    result = torchrun(cp_overrides(run_dir, cache_dir, short_documents, **{"trainer.context_parallel": 2}))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_train_py_with_context_parallel_trains_like_one_process(cp_run, single_cp_reference):
    rows = losses(cp_run)
    assert [r[0] for r in rows] == list(range(1, STEPS + 1))  # rank 0 alone writes
    assert sum(r[2] is not None for r in rows) == 2
    assert_trains_alike(rows, losses(single_cp_reference))
    state = load_checkpoint(cp_run / "checkpoints" / f"step_{STEPS:08d}.pt")
    assert state["config"]["trainer"]["context_parallel"] == 2 and state["config"]["run"]["world_size"] == 2
    single = load_checkpoint(single_cp_reference / "checkpoints" / f"step_{STEPS:08d}.pt")
    assert state["sampler"] == {**single["sampler"], "world_size": 1}  # one DP rank read the same windows
    for k, v in single["model"].items():
        torch.testing.assert_close(state["model"][k], v, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.slow
def test_context_parallel_checkpoint_resumes_on_one_process(cp_run, tmp_path, cache_dir, short_documents):
    ckpt = cp_run / "checkpoints" / "step_00000004.pt"
    assert run_in_process(cp_overrides(tmp_path, cache_dir, short_documents, resume=str(ckpt))) == 0
    assert_trains_alike(losses(tmp_path), losses(cp_run)[4:])


@pytest.mark.slow
def test_single_process_checkpoint_resumes_with_context_parallel(single_cp_reference, tmp_path, cache_dir,
                                                                 short_documents):
    ckpt = single_cp_reference / "checkpoints" / "step_00000004.pt"
    result = torchrun(cp_overrides(tmp_path, cache_dir, short_documents, resume=str(ckpt),
                                   **{"trainer.context_parallel": 2}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_trains_alike(losses(tmp_path), losses(single_cp_reference)[4:])


# ----------------------------------------------------------------------------- refused before any work

@pytest.mark.parametrize("world, extra, message", [
    (1, {"trainer.context_parallel": 2}, "trainer.context_parallel=2 splits each sequence over 2 processes: start "
                                         "a multiple of 2 of them with torchrun --nproc_per_node=N"),
    (2, {"trainer.context_parallel": 3}, "trainer.context_parallel=3 does not divide the 2 processes"),
    (2, {"trainer.context_parallel": 2, "trainer.seq_len": 62},
     "trainer.seq_len=62 is not divisible by 2 x trainer.context_parallel = 4"),
    (2, {"trainer.context_parallel": 2, "attention": "sdpa"}, "trainer.context_parallel=2 needs attention=flash or "
                                                              "naive"),
    (4, {"trainer.context_parallel": 2, "trainer.grad_accum": 3},
     "trainer.grad_accum=3 is not divisible by the 2 data-parallel groups (4 processes / "
     "trainer.context_parallel=2)"),
    (2, {"trainer.context_parallel": 0}, "trainer.context_parallel=0: must be a positive integer"),
    (2, {"trainer.context_parallel": 2, "attention.deterministic": False},
     "trainer.context_parallel=2: the ring runs our kernel's deterministic backward only"),
    (2, {"trainer.context_parallel": 2, "model.attention_dropout": 0.1},
     "trainer.context_parallel=2: the ring computes attention without dropout"),
    (2, {"trainer.context_parallel": 2, "attention.kernel": "gluon"},
     "trainer.context_parallel=2: the ring's blocks run the Triton kernels"),
    (2, {"trainer.context_parallel": 2, "attention.backward_kernel": "gluon"},
     "trainer.context_parallel=2: the ring's blocks run the Triton kernels"),
])
def test_unsupported_context_parallel_is_one_line_exit_2(tmp_path, cache_dir, short_documents, capsys, monkeypatch,
                                                         world, extra, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # as torchrun starts rank 0 (a lone WORLD_SIZE is refused)
    assert run_in_process(cp_overrides(tmp_path, cache_dir, short_documents, **extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert not (tmp_path / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- scripts/max_context.py

MAX_CONTEXT = ["model.vocab_size=256", "model.n_layer=1", "model.d_model=64", "model.n_head=8", "model.n_kv_head=8",
               "features=[plain]", "start=256", "granularity=256", "cap=8192",
               "memory_budget_mb=12", "device=cpu"]


@pytest.fixture
def max_context_module():
    import sys
    sys.path.insert(0, str(REPO / "scripts"))
    import max_context
    return max_context


@pytest.mark.slow
def test_max_context_under_torchrun_splits_one_sequence_over_the_ranks(tmp_path, max_context_module):
    """Two CPU ranks with C = 2 against one process on the same live-tensor budget: the split
    sequence reaches further; the results record the world size and C, and the GPU-count plot
    draws both."""
    import json
    import subprocess
    import sys

    one = max_context_module.run(max_context_module.compose_config(MAX_CONTEXT, ["naive"], tmp_path, "one"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(REPO / "scripts" / "max_context.py"), *MAX_CONTEXT, "--attention", "naive", "--out", str(tmp_path),
               "trainer.context_parallel=2"]
    result = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "max_context_cpu_x2_cp2.json").read_text())
    assert two["settings"]["world_size"] == 2 and two["settings"]["context_parallel"] == 2
    single_max, split_max = one["results"][0]["max_length"], two["results"][0]["max_length"]
    assert 0 < single_max < split_max < 8192, (single_max, split_max)
    assert any(not p["fits"] for p in two["results"][0]["probes"])  # it did run out, and went on
    assert "2 processes (torchrun), each sequence split over 2" in (tmp_path / "max_context_cpu_x2_cp2.md").read_text()

    plot = subprocess.run([sys.executable, str(REPO / "scripts" / "plot_max_context.py"), str(tmp_path / "one.json"),
                           str(tmp_path / "max_context_cpu_x2_cp2.json"), "--out", str(tmp_path)],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert f"naive, plain: 1 GPU: {single_max:,}, 2 GPUs: {split_max:,}" in plot.stdout
    assert (tmp_path / "max_context_gpus.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("world, override, message", [
    (2, "granularity=250", "granularity=250 is not a multiple of 2 x trainer.context_parallel = 4"),
    (2, "sdpa", "trainer.context_parallel=2 needs attention=flash or naive"),
    (3, "granularity=256", "trainer.context_parallel=2 does not divide the 3 processes"),
    (1, "granularity=256", "trainer.context_parallel=2 splits each sequence over 2 processes"),
])
def test_max_context_refuses_what_the_ring_cannot_run(max_context_module, world, override, message):
    attention = [override] if "=" not in override else ["naive"]   # a bare name: the --attention value
    overrides = [o for o in MAX_CONTEXT if not o.startswith(override.split("=")[0])]
    if "=" in override:
        overrides.append(override)
    cfg = max_context_module.compose_config(overrides + ["trainer.context_parallel=2",
                                             *(["start=250", "cap=8000"] if override == "granularity=250" else [])],
                                            attention)
    with pytest.raises(ValueError, match=message):
        max_context_module.validate(cfg, torch.device("cpu"), world)


def test_plot_needs_two_gpu_counts_of_one_search(tmp_path, max_context_module):
    import plot_max_context

    path = tmp_path / "one.json"
    path.write_text('{"settings": {}, "model": {"name": "tiny"}, "metadata": {"device": "cpu"}, "results": '
                    '[{"impl": "flash", "features": "plain", "max_length": 1024, "capped": false, "error": null}]}')
    with pytest.raises(ValueError, match="^no .attention, features. pair was measured at two or more GPU counts"):
        plot_max_context.main([str(path), "--out", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="no such results file"):
        plot_max_context.main([str(tmp_path / "missing.json")])


# ----------------------------------------------------------------------------- two GPUs (NCCL, bf16)

GPU_OVERRIDES = ["model.n_layer=2", "model.d_model=256", "model.n_head=8", "model.n_kv_head=2",
                 f"model.vocab_size={VOCAB}", "trainer.batch_size=1", "trainer.grad_accum=1", "trainer.seq_len=8192",
                 "optim.warmup_steps=0", "optim.grad_clip=0", "device=cuda"]


def gpu_step(device, precision: str, attention: str, env=None) -> dict:
    """One training step of a small GPT on 8K tokens: the loss (mean over ranks) and every
    parameter gradient, in float32 on the CPU."""
    import torch.distributed as dist

    from training.config import compose
    from training.builders import model_from_config
    from training.loop.step import TrainStep
    from training.parallel.plan import ParallelPlan

    size = env.cp_size if env else 1
    cfg = compose(GPU_OVERRIDES + [f"trainer.precision={precision}", f"trainer.context_parallel={size}"])
    torch.manual_seed(0)
    model = model_from_config(cfg, VOCAB, attention=attention).to(device)
    step = TrainStep(model, cfg, device, ParallelPlan(env, cfg.trainer.parallel), micro_steps=1)
    grads = {}
    step.optimizer.register_step_pre_hook(lambda *_: grads.update(
        {n: p.grad.float().cpu() for n, p in model.named_parameters()}))
    g = torch.Generator().manual_seed(5)
    idx, targets = (torch.randint(VOCAB, (1, 8192), generator=g) for _ in range(2))
    targets[0, :1000] = -100
    loss, _ = step(lambda: (idx, targets))
    if env:
        dist.all_reduce(loss)
        loss /= env.world_size
    return {"loss": loss.float().cpu(), "grads": grads}


def _gpu_worker(rank: int, port: int, path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from training.parallel.distributed import close_distributed, init_distributed

    env = init_distributed("cuda", timeout_s=300, context_parallel=2)
    try:
        result = gpu_step(torch.device("cuda", rank), "bf16", "flash", env)
        if rank == 0:
            torch.save(result, path)
    finally:
        close_distributed()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_context_parallel_step_on_two_gpus_is_as_close_as_bf16_allows(tmp_path):
    """C = 2 over NCCL with our kernel in bf16 against the float32 step on one GPU: the loss and
    the gradients at most twice as far from it as the bf16 step on one GPU is."""
    path = tmp_path / "cp.pt"
    start_ranks(_gpu_worker, (free_port(), str(path)), 2, tmp_path)
    got = torch.load(path)
    exact = gpu_step(torch.device("cuda"), "fp32", "naive")
    plain = gpu_step(torch.device("cuda"), "bf16", "flash")

    def flat(r):
        return torch.cat([r["grads"][k].flatten() for k in sorted(exact["grads"])])

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    loss_err, loss_bound = rel(got["loss"], exact["loss"]), 2 * rel(plain["loss"], exact["loss"]) + 1e-3
    assert loss_err <= loss_bound, (loss_err, loss_bound)
    grad_err, grad_bound = rel(flat(got), flat(exact)), 2 * rel(flat(plain), flat(exact))
    assert grad_err <= grad_bound, (grad_err, grad_bound)
