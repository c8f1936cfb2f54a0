"""Several processes on the CPU (gloo): DDP and FSDP2 steps against the single-process step,
checkpoints moved between 1 and 2 processes, a killed rank, stop signals and a killed launcher
under torchrun (and training.launch's exit statuses), and two processes building one token cache
at once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.spawned import LISTS_THREADS, free_port, gloo_threads, start_ranks
from tests.trainrun import REPO, cache_dir, losses, run_in_process, subprocess_env, tiny_overrides  # noqa: F401 (fixture)
from training.run.store import CheckpointStore, load_checkpoint

WORLD = 2


# ----------------------------------------------------------------------------- one step, three ways

STEP_OVERRIDES = ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.n_kv_head=2", "model.vocab_size=64",
                  "trainer.batch_size=2", f"trainer.grad_accum={WORLD}", "trainer.precision=fp32",
                  "optim.warmup_steps=0", "optim.grad_clip=0.05", "device=cpu"]  # a clip that bites


def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [tuple(torch.randint(64, (2, 16), generator=g) for _ in range(2)) for _ in range(WORLD)]


def run_steps(parallel: str | None, rank: int = 0, world: int = 1, env=None, precision: str = "fp32",
              compiled: bool = False) -> tuple[dict, dict]:
    """Two optimizer steps of the tiny GPT (float64, or float32 under bf16 autocast / FSDP's bf16
    parameters) on the same global batches; the full state. `compiled`: trainer.compile=true with
    the aot_eager backend (torch.compile's graphs and graph breaks, no C++ build)."""
    import functools

    from training.config import compose
    from training.builders import model_from_config
    from training.loop.step import TrainStep
    from training.parallel.plan import ParallelPlan

    cfg = compose(STEP_OVERRIDES + [f"trainer.precision={precision}", f"trainer.compile={compiled}"]
                  + ([f"trainer.parallel={parallel}"] if parallel else []))
    torch.manual_seed(0)
    model = model_from_config(cfg, 64, attention="sdpa").to(torch.float64 if precision == "fp32" else torch.float32)
    compile_ = torch.compile
    torch.compile = functools.partial(compile_, backend="aot_eager")
    try:
        step = TrainStep(model, cfg, torch.device("cpu"), ParallelPlan(env, cfg.trainer.parallel))
    finally:
        torch.compile = compile_
    if compiled and parallel == "fsdp":  # the blocks and the head with its loss, each a compiled function
        assert all(hasattr(f, "_torchdynamo_orig_callable") for f in [model.head_loss, *(b.forward for b in model.blocks)])
    for s in range(2):
        mine = micro_batches(s)[rank::world]  # rank r: micro-batch r of the global batch
        it = iter(mine)
        step(lambda: next(it))
    return step.full_state()


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from training.parallel.distributed import close_distributed, init_distributed

    env = init_distributed("cpu", timeout_s=60)
    try:
        for parallel, precision in (("ddp", "fp32"), ("fsdp", "fp32"), ("ddp", "bf16"), ("fsdp", "bf16")):
            state = run_steps(parallel, rank, WORLD, env, precision)
            if rank == 0:
                torch.save(state, f"{out}/{parallel}-{precision}.pt")
        state = run_steps("fsdp", rank, WORLD, env, "fp32", compiled=True)
        if rank == 0:
            torch.save(state, f"{out}/fsdp-compiled.pt")
    finally:
        del env  # its control group is the world group: let go of it, as train.py lets go of its trainer
        close_distributed()
    Path(out, f"threads{rank}.txt").write_text(" ".join(gloo_threads()))


@pytest.fixture(scope="module")
def parallel_states(tmp_path_factory):
    out = tmp_path_factory.mktemp("steps")
    start_ranks(_worker, (free_port(), str(out)), WORLD, out)
    states = {name: torch.load(out / f"{name}.pt", weights_only=True)
              for name in ("ddp-fp32", "fsdp-fp32", "ddp-bf16", "fsdp-bf16", "fsdp-compiled")}
    states["threads after close"] = [(out / f"threads{rank}.txt").read_text().split() for rank in range(WORLD)]
    return states


def assert_states_close(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (model_a, optim_a), (model_b, optim_b) = a, b
    assert model_a.keys() == model_b.keys()
    for k in model_a:
        torch.testing.assert_close(model_a[k], model_b[k], rtol=1e-12, atol=1e-12, msg=k)
    assert optim_a["state"].keys() == optim_b["state"].keys() and optim_a["param_groups"] == optim_b["param_groups"]
    for i, moments in optim_a["state"].items():
        for name, value in moments.items():
            torch.testing.assert_close(value, optim_b["state"][i][name], rtol=1e-12, atol=1e-14, msg=f"{i}.{name}")


def test_ddp_step_equals_the_single_process_step(parallel_states):
    single = run_steps(None)
    start = model_from_default()
    assert any(not torch.equal(single[0][k], v) for k, v in start.items())  # the steps did change the weights
    assert_states_close(parallel_states["ddp-fp32"], single)


def test_fsdp_step_equals_the_ddp_step(parallel_states):
    assert_states_close(parallel_states["fsdp-fp32"], parallel_states["ddp-fp32"])


def test_compiled_fsdp_step_equals_the_eager_one(parallel_states):
    """FSDP2 with its blocks and its head + loss compiled (aot_eager: the same graphs torch.compile
    makes, run without a C++ build), float64: the same weights and moments as eager to 1e-12."""
    assert_states_close(parallel_states["fsdp-compiled"], parallel_states["fsdp-fp32"])


@pytest.mark.skipif(not LISTS_THREADS, reason="lists threads through Linux's /proc")
def test_leaving_the_group_after_fsdp_ends_the_gloo_threads(parallel_states):
    """close_distributed after FSDP2 (eager and compiled): no gloo or TCPStore thread runs on into
    interpreter shutdown, which is where gloo's teardown has ended a rank with a signal."""
    assert parallel_states["threads after close"] == [[]] * WORLD


def test_dtensor_caches_are_emptied_and_one_a_torch_release_lacks_is_passed_over(monkeypatch):
    import torch.distributed.tensor._redistribute as redistribute

    from training.parallel import distributed

    redistribute._planner_cache[("a key", None)] = "a planner"
    monkeypatch.setattr(distributed, "DTENSOR_CACHES", (("torch.distributed.tensor._redistribute", "no_such_cache"),
                                                        ("torch.distributed.no_such_module", "cache_clear"),
                                                        *distributed.DTENSOR_CACHES))
    distributed.release_dtensor_caches()
    assert redistribute._planner_cache == {}


def test_fsdp_bf16_parameters_train_like_ddp_under_bf16_autocast(parallel_states):
    """FSDP's bf16 gathered parameters with float32 gradient reduction against DDP's bf16
    autocast: not bit-equal (other roundings), but as close as bf16 is to float32, and far closer
    than the two steps' update itself."""
    start = {k: v.float() for k, v in model_from_default().items()}
    fsdp, ddp, fp32 = (parallel_states[k][0] for k in ("fsdp-bf16", "ddp-bf16", "ddp-fp32"))
    total = lambda a, b: sum(float((a[k].float() - b[k].float()).norm()) ** 2 for k in start) ** 0.5  # noqa: E731
    diff, noise, update = total(fsdp, ddp), total(ddp, fp32), total(ddp, start)
    assert diff < 2 * noise and diff < 0.1 * update, (diff, noise, update)
    for k in start:
        assert (fsdp[k] - ddp[k]).norm() < 0.2 * (ddp[k] - start[k]).norm(), k


def model_from_default() -> dict:
    from training.config import compose
    from training.builders import model_from_config

    torch.manual_seed(0)
    return model_from_config(compose(STEP_OVERRIDES), 64, attention="sdpa").double().state_dict()


# ----------------------------------------------------------------------------- train.py under torchrun

def torchrun_command(overrides: list[str], nproc: int = WORLD, launcher: str = "torch.distributed.run") -> list[str]:
    """torchrun itself, or (launcher="training.launch") torchrun with train.py's exit statuses."""
    return [sys.executable, "-m", launcher, "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "train.py"), *overrides]


def torchrun(overrides: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    result = subprocess.run(torchrun_command(overrides), cwd=REPO, env=subprocess_env(), capture_output=True,
                            text=True, timeout=timeout)
    return result


STEPS = 24  # long enough that a rank can be killed mid-run


def dist_overrides(run_dir, cache, steps: int = STEPS, **extra) -> list[str]:
    return tiny_overrides(run_dir, cache, steps, **{"trainer.grad_accum": WORLD, "trainer.eval_every": 12,
                                                    "trainer.keep_ckpts": 10, **extra})


def assert_losses_close(a: list[tuple], b: list[tuple]) -> None:
    """Same steps, lr and tokens; losses to float32 rounding (ranks add gradients in another order)."""
    assert [r[0] for r in a] == [r[0] for r in b] and [r[3:5] for r in a] == [r[3:5] for r in b]
    for ra, rb in zip(a, b):
        assert ra[1] == pytest.approx(rb[1], rel=1e-5, abs=1e-6), (ra, rb)
        assert (ra[2] is None) == (rb[2] is None) and (ra[2] is None or ra[2] == pytest.approx(rb[2], rel=1e-5))


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("single")
    assert run_in_process(dist_overrides(run_dir, cache_dir)) == 0
    return run_dir


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, cache_dir):
    """Two ranks, DDP, one fresh token cache built by rank 0 while rank 1 waits."""
    run_dir = tmp_path_factory.mktemp("ddp")
    result = torchrun(dist_overrides(run_dir, tmp_path_factory.mktemp("fresh-cache")))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_two_ranks_train_like_one_and_only_rank0_writes(ddp_run, single_run):
    rows = losses(ddp_run)
    assert [r[0] for r in rows] == list(range(1, STEPS + 1))  # one row per step: rank 0 alone writes
    assert_losses_close(rows, losses(single_run))
    state = load_checkpoint(ddp_run / "checkpoints" / f"step_{STEPS:08d}.pt")
    assert state["config"]["run"]["world_size"] == WORLD and state["tokens"] == STEPS * 4 * 64 * WORLD
    assert (ddp_run / "model.safetensors").exists()


@pytest.mark.slow
def test_checkpoint_of_two_ranks_resumes_on_one(ddp_run, tmp_path, cache_dir):
    ckpt = ddp_run / "checkpoints" / "step_00000004.pt"
    assert run_in_process(dist_overrides(tmp_path, cache_dir, resume=str(ckpt))) == 0
    assert_losses_close(losses(tmp_path), losses(ddp_run)[4:])  # steps 5..24


@pytest.mark.slow
def test_checkpoint_of_one_resumes_on_two_ranks_with_fsdp(single_run, tmp_path, cache_dir):
    ckpt = single_run / "checkpoints" / "step_00000004.pt"
    result = torchrun(dist_overrides(tmp_path, cache_dir, resume=str(ckpt), **{"trainer.parallel": "fsdp"}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_losses_close(losses(tmp_path), losses(single_run)[4:])


def worker_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (its children), from /proc."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            ranks[int(env["RANK"])] = pid
    return ranks


def start_and_interrupt(overrides: list[str], run_dir: Path, after_steps: int, act,
                        launcher: str = "torch.distributed.run") -> int:
    launcher = subprocess.Popen(torchrun_command(overrides, launcher=launcher), cwd=REPO, env=subprocess_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 120
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < after_steps) and \
            launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert launcher.poll() is None, f"torchrun ended before it could be interrupted: {launcher.stderr.read()[-3000:]}"
    act(launcher)
    launcher.wait(timeout=90)  # bounded: the survivors must not hang
    return launcher.returncode


@pytest.mark.slow
def test_killed_rank_then_resume_auto_is_bit_identical(tmp_path, cache_dir, ddp_run):
    run_dir = tmp_path / "run"
    overrides = dist_overrides(run_dir, cache_dir, resume="auto")  # ddp_run's run, resumable
    status = start_and_interrupt(overrides, run_dir, after_steps=10,
                                 act=lambda p: os.kill(worker_pids(p)[1], signal.SIGKILL))
    assert status != 0 and len(losses(run_dir)) < STEPS
    assert CheckpointStore(run_dir).list()  # resume=auto will start from one of them
    result = torchrun(overrides)  # the same command again
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(run_dir) == losses(ddp_run)


@pytest.mark.slow
@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_sigterm_to_torchrun_stops_every_rank_at_one_step(tmp_path, cache_dir, sig, status):
    """Through `python -m training.launch` (torchrun with train.py's statuses; torchrun itself exits 1)."""
    run_dir = tmp_path / "run"
    overrides = dist_overrides(run_dir, cache_dir, 200, resume="auto", **{"trainer.ckpt_every": 0,
                                                                         "trainer.eval_every": 0})
    assert start_and_interrupt(overrides, run_dir, after_steps=5, act=lambda p: p.send_signal(sig),
                               launcher="training.launch") == status
    saved = CheckpointStore(run_dir).list()
    assert len(saved) == 1  # one consistent checkpoint, written once
    stopped_at = load_checkpoint(saved[0])["step"]
    assert 5 <= stopped_at < 200 and len(losses(run_dir)) == stopped_at


@pytest.mark.slow
def test_workers_of_a_killed_launcher_save_and_stop_instead_of_training_on(tmp_path, cache_dir):
    """The issue: SIGKILL to torchrun left both workers training as orphans (589 metric rows 20 s later)."""
    run_dir = tmp_path / "run"
    overrides = dist_overrides(run_dir, cache_dir, 100_000, **{"trainer.ckpt_every": 0, "trainer.eval_every": 0})
    workers: dict[int, int] = {}

    def kill_launcher(launcher: subprocess.Popen) -> None:
        workers.update(worker_pids(launcher))
        launcher.send_signal(signal.SIGKILL)

    start_and_interrupt(overrides, run_dir, after_steps=5, act=kill_launcher)
    assert len(workers) == WORLD
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in workers.values() if Path(f"/proc/{pid}").exists()]
    for pid in alive:  # only our own workers, by pid, so a failure leaves no process behind
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the workers trained on after their launcher died"
    (saved,) = CheckpointStore(run_dir).list()  # saved at the step boundary where they noticed
    assert load_checkpoint(saved)["step"] == len(losses(run_dir)) < 100_000


@pytest.mark.slow
def test_a_config_error_under_the_launcher_is_one_line_from_rank_0_and_its_status(tmp_path, cache_dir):
    result = subprocess.run(torchrun_command(dist_overrides(tmp_path, cache_dir, **{"optim.lr": "abc"}),
                                             launcher="training.launch"),
                            cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: optim.lr='abc': must be a number > 0"]


def test_the_launcher_maps_a_second_signal_and_a_failed_worker_to_train_pys_statuses(monkeypatch):
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    import torch.distributed.run as torchrun_module
    import training.launch as launch

    def second_ctrl_c(args):  # what torchrun raises again when Ctrl-C comes while it waits for the workers
        raise SignalException("got signal: 2", sigval=signal.SIGINT)

    monkeypatch.setattr(torchrun_module, "run", second_ctrl_c)
    assert launch.main(["--standalone", "--nproc_per_node=2", "train.py"]) == 130

    def worker_failed(args):
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file="")
        raise ChildFailedError("train.py", {0: failure})

    monkeypatch.setattr(torchrun_module, "run", worker_failed)
    assert launch.main(["--standalone", "--nproc_per_node=2", "train.py"]) == 2


# ----------------------------------------------------------------------------- the sampler over 1 -> 2 -> 1 processes

SAMPLER_DATA = {"name": "stdlib", "max_bytes": 20_000, "include_tests": True, "val_fraction": 0.05}


def sampler_of(cache: str, rank: int = 0, world: int = 1):
    from omegaconf import OmegaConf

    from training.builders import build_data
    cfg = OmegaConf.create({"data": {**SAMPLER_DATA, "cache_dir": cache}, "tokenizer": {"name": "bytes"}})
    return build_data(cfg, seq_len=256, seed=7, rank=rank, world_size=world, progress=False).train


def _sampler_worker(rank: int, port: int, cache: str, state_path: str, out: str, steps: int) -> None:
    """One of two gloo ranks: continue the saved position, draw `steps` batches, gather them."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from training.parallel.distributed import close_distributed, init_distributed

    env = init_distributed("cpu", timeout_s=60)
    try:
        sampler = sampler_of(cache, env.dp_rank, env.dp_size)
        sampler.load_state_dict(torch.load(state_path))
        rows = torch.cat([sampler.next_batch(3)[0] for _ in range(steps)])
        gathered = [None] * WORLD
        torch.distributed.all_gather_object(gathered, (rows, sampler.state_dict()))
        if rank == 0:
            torch.save(gathered, out)
    finally:
        close_distributed()


@pytest.mark.slow
def test_moving_windows_through_one_two_one_processes_neither_repeat_nor_skip(tmp_path):
    """1 process, then 2 gloo ranks from its position across an epoch boundary, then 1 again from
    theirs: within each epoch every window is drawn once, in the epoch's order, none skipped."""
    cache = str(tmp_path / "cache")
    one = sampler_of(cache)
    per_epoch = len(one.order(0))
    first = torch.cat([one.next_batch(3)[0] for _ in range((per_epoch - 12) // 3)])
    torch.save(one.state_dict(), tmp_path / "state.pt")
    start_ranks(_sampler_worker, (free_port(), cache, str(tmp_path / "state.pt"), str(tmp_path / "two.pt"), 4),
                WORLD, tmp_path)
    (rows0, state0), (rows1, state1) = torch.load(tmp_path / "two.pt")
    assert state0 == state1 and state0["epoch"] == 1   # one global position; the ranks crossed into epoch 1
    again = sampler_of(cache)
    again.load_state_dict(state0)
    last = torch.cat([again.next_batch(3)[0] for _ in range(3)])
    # Rank r drew slot entries r, r + 2, ...: interleave the ranks' rows back into the global order.
    middle = torch.stack([rows0, rows1], dim=1).flatten(0, 1)
    index = {tuple(one.window(int(i), e)[:-1].tolist()): (e, int(i)) for e in (0, 1) for i in one.order(e)}
    assert len(index) == len(one.order(0)) + len(one.order(1))   # no two windows alike: tokens identify one
    drawn = [index[tuple(row.tolist())] for row in torch.cat([first, middle, last])]
    assert len(set(drawn)) == len(drawn)   # nothing repeated
    for epoch in (0, 1):
        got = [i for e, i in drawn if e == epoch]
        assert got == one.order(epoch)[: len(got)].tolist()   # in the epoch's order, nothing skipped
    assert per_epoch - len([d for d in drawn if d[0] == 0]) < WORLD   # epoch 0 ends with < 2 entries left
    assert one.offset(0) != one.offset(1)


# ----------------------------------------------------------------------------- the token cache

def test_two_processes_building_one_cache_both_get_a_valid_one(tmp_path):
    code = ("import sys; from omegaconf import OmegaConf; from training.builders import build_data; "
            "cfg = OmegaConf.create({'data': {'name': 'stdlib', 'max_bytes': 300000, 'include_tests': False, "
            "'val_fraction': 0.1, 'cache_dir': sys.argv[1]}, 'tokenizer': {'name': 'bytes'}}); "
            "b = build_data(cfg, seq_len=64, seed=0, progress=False); print(b.cache.path, b.cache.n_tokens)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    assert len({out for out, _ in outputs}) == 1
    folders = [p.name for p in (tmp_path / "tokens").iterdir()]
    assert len(folders) == 1 and ".tmp" not in folders[0]


@pytest.mark.slow
def test_weights_export_loads_for_eval_on_one_process(ddp_run, tmp_path):
    from training.builders import build_data
    from training.builders import load_model_for_eval
    from training.loop.evaluate import evaluate_loss

    model, cfg, _ = load_model_for_eval(ddp_run / "model.safetensors", device="cpu")
    batches = build_data(cfg, seq_len=cfg.trainer.seq_len, seed=cfg.seed).val_batches(cfg.trainer.batch_size,
                                                                                     cfg.trainer.eval_batches)
    assert evaluate_loss(model, batches, torch.device("cpu"), "fp32") == pytest.approx(losses(ddp_run)[-1][2], rel=1e-6)
    exported = tmp_path / "w.safetensors"  # the script's export of the last checkpoint holds the same weights
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "export_weights.py"),
                             str(ddp_run / "checkpoints" / f"step_{STEPS:08d}.pt"), str(exported)],
                            cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    again, _, _ = load_model_for_eval(exported, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_global_batch_that_the_ranks_cannot_split_is_one_line_before_any_work(tmp_path, cache_dir, capsys,
                                                                                monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # as torchrun starts rank 0 (a lone WORLD_SIZE is refused)
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, **{"trainer.grad_accum": 3})) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("error: trainer.grad_accum=3 is not divisible by the 2 processes: the global batch is "
                   "trainer.batch_size x trainer.grad_accum sequences; set trainer.grad_accum to a multiple of 2")
