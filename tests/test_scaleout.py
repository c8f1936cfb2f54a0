"""Past one process group on one machine (CPU, gloo): sharded DCP checkpoints of FSDP2 runs
(a kill mid-save, corruption, N -> M resumes, the export tool), elastic restarts under
`torchrun --max-restarts` with `resume=auto`, and two torchrun agents as two "nodes"."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.test_distributed import (STEPS, WORLD, assert_losses_close, dist_overrides, free_port, single_run,  # noqa: F401
                                    torchrun, worker_pids)
from tests.trainrun import REPO, cache_dir, losses, run_in_process, subprocess_env  # noqa: F401 (fixtures)
from training.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, prune_checkpoints


# ----------------------------------------------------------------------------- DCP, a kill mid-save

def _tiny_fsdp(env):
    from training.config import compose
    from training.trainer import TrainStep, model_from_config

    cfg = compose(["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.n_kv_head=2", "model.vocab_size=64",
                   "trainer.batch_size=2", f"trainer.grad_accum={WORLD}", "trainer.precision=fp32",
                   "trainer.parallel=fsdp", "device=cpu"])
    torch.manual_seed(0)
    step = TrainStep(model_from_config(cfg, 64, attention="sdpa"), cfg, torch.device("cpu"), env)
    g = torch.Generator().manual_seed(env.rank)
    batch = [tuple(torch.randint(64, (2, 16), generator=g) for _ in range(2))]
    step(lambda: batch[0])   # AdamW moments exist
    return step


def _meta(step: int) -> dict:
    return {"step": step, "tokens": 0, "rng": {}, "sampler": {}, "config": {}, "wandb_id": None,
            "lineage": {"id": "abc", "parent": None}}


def _save_then_die_mid_save(rank: int, port: int, ckpt_dir: str) -> None:
    """Save step 1 whole; save step 2, and SIGKILL rank 0 after every shard and the manifest are
    written, just before the rename that would make the folder a checkpoint."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import training.dcp
    from training.checkpoint import checkpoint_path, save_sharded_checkpoint
    from training.distributed import close_distributed, init_distributed

    env = init_distributed("cpu", timeout_s=30)
    try:
        step = _tiny_fsdp(env)
        run_dir = Path(ckpt_dir).parent
        save_sharded_checkpoint(checkpoint_path(run_dir, 1, sharded=True), _meta(1), step.model, step.optimizer, env)
        full, _ = step.full_state()
        if rank == 0:
            torch.save(full, Path(ckpt_dir).parent / "full.pt")
        training.dcp._publish = lambda tmp, path: os.kill(os.getpid(), signal.SIGKILL)
        save_sharded_checkpoint(checkpoint_path(run_dir, 2, sharded=True), _meta(2), step.model, step.optimizer, env)
    finally:
        close_distributed()


@pytest.mark.slow
def test_a_kill_mid_save_leaves_the_previous_sharded_checkpoint_in_use(tmp_path):
    from training.dcp import consolidate

    ckpt_dir = tmp_path / "checkpoints"
    with pytest.raises(Exception):  # rank 0 killed, rank 1 fails its next collective
        mp.spawn(_save_then_die_mid_save, args=(free_port(), str(ckpt_dir)), nprocs=WORLD, join=True)
    assert [p.name for p in list_checkpoints(ckpt_dir)] == ["step_00000001.dcp"]
    assert (ckpt_dir / "step_00000002.dcp.tmp" / "manifest.json").is_file()  # all written, never published
    path, state = latest_checkpoint(ckpt_dir)
    assert path.name == "step_00000001.dcp" and state["step"] == 1 and "model" not in state

    # One process reads the folder two ranks wrote: the whole weights, the moments by position.
    whole, full = consolidate(path), torch.load(tmp_path / "full.pt", weights_only=True)
    assert whole["model"].keys() == full.keys()
    assert all(torch.equal(whole["model"][k], full[k]) for k in full)
    assert {k for m in whole["optimizer"]["state"].values() for k in m} == {"step", "exp_avg", "exp_avg_sq"}
    assert all(torch.isfinite(m["exp_avg"]).all() for m in whole["optimizer"]["state"].values())

    prune_checkpoints(ckpt_dir, keep=1, run_id="abc")   # the dead save's leftover goes with the next prune
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_00000001.dcp"]

    shard = next(path.glob("__1_*.distcp"))   # one flipped byte in one rank's shard: refused, named
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name} does not match its sha256"):
        load_checkpoint(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        load_checkpoint(path)


# ----------------------------------------------------------------------------- FSDP2 runs: DCP, N -> M, elastic

@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("fsdp")
    result = torchrun(dist_overrides(run_dir, cache_dir, **{"trainer.parallel": "fsdp"}))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_fsdp_writes_sharded_checkpoints_that_resume_on_one_process(fsdp_run, single_run, tmp_path, cache_dir):
    saved = list_checkpoints(fsdp_run / "checkpoints")
    assert [p.name for p in saved] == [f"step_{s:08d}.dcp" for s in range(4, STEPS + 1, 4)]
    assert sorted(q.name for q in saved[-1].glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert [r[0] for r in losses(fsdp_run)] == list(range(1, STEPS + 1))   # rank 0 alone wrote metrics
    assert_losses_close(losses(fsdp_run), losses(single_run))
    assert (fsdp_run / "model.safetensors").exists()   # the export, read back from the last folder
    assert run_in_process(dist_overrides(tmp_path, cache_dir, resume=str(saved[2]))) == 0   # 2 ranks -> 1
    assert_losses_close(losses(tmp_path), losses(single_run)[12:])


def start(command: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """A launcher whose output goes to `log` (a file: a pipe would stay open in any process that
    outlived it, and reading it would wait for that one too)."""
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=REPO, env=env or subprocess_env(), stdout=out, stderr=subprocess.STDOUT)


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


def wait_for_rows(run_dir: Path, n: int, log: Path, *procs: subprocess.Popen, timeout: float = 120) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while not metrics.exists() or len(metrics.read_text().splitlines()) < n:
        assert all(p.poll() is None for p in procs), f"a launcher ended early: {tail(log)}"
        assert time.monotonic() < deadline, f"no {n} metric rows in {timeout} s: {tail(log)}"
        time.sleep(0.01)


@pytest.mark.slow
def test_max_restarts_after_a_killed_rank_continues_bit_identically(fsdp_run, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               "--max-restarts=1", str(REPO / "train.py"),
               *dist_overrides(run_dir, cache_dir, resume="auto", **{"trainer.parallel": "fsdp"})]
    log = tmp_path / "torchrun.log"
    launcher = start(command, log)
    wait_for_rows(run_dir, 10, log, launcher)
    os.kill(worker_pids(launcher)[1], signal.SIGKILL)
    assert launcher.wait(timeout=180) == 0, tail(log)
    assert losses(run_dir) == losses(fsdp_run)   # every logged value, each step once
    rows = [json.loads(line) for line in (run_dir / "lineage.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows] == ["start", "resume"] and rows[0]["run_id"] == rows[1]["run_id"]
    assert 4 <= rows[1]["step"] <= 12
