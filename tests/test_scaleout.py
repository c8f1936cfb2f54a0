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

from tests.spawned import free_port
from tests.test_distributed import (STEPS, WORLD, assert_losses_close, dist_overrides, single_run,  # noqa: F401
                                    torchrun, worker_pids)
from tests.trainrun import REPO, cache_dir, losses, run_in_process, subprocess_env  # noqa: F401 (fixtures)
from training.run.store import CheckpointError, CheckpointStore, load_checkpoint


# ----------------------------------------------------------------------------- DCP, a kill mid-save

def _tiny_fsdp(env):
    from training.builders import model_from_config
    from training.config import compose
    from training.loop.step import TrainStep
    from training.parallel.plan import ParallelPlan

    cfg = compose(["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.n_kv_head=2", "model.vocab_size=64",
                   "trainer.batch_size=2", f"trainer.grad_accum={WORLD}", "trainer.precision=fp32",
                   "trainer.parallel=fsdp", "device=cpu"])
    torch.manual_seed(0)
    step = TrainStep(model_from_config(cfg, 64, attention="sdpa"), cfg, torch.device("cpu"),
                     ParallelPlan(env, cfg.trainer.parallel))
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
    import training.run.dcp
    from training.parallel.distributed import close_distributed, init_distributed

    env = init_distributed("cpu", timeout_s=30)
    try:
        step = _tiny_fsdp(env)
        store = CheckpointStore(Path(ckpt_dir).parent)
        store.save(_meta(1), step.model, step.optimizer, step.plan)   # the plan shards the state: a DCP folder
        full, _ = step.full_state()
        if rank == 0:
            torch.save(full, Path(ckpt_dir).parent / "full.pt")
        training.run.dcp._publish = lambda tmp, path: os.kill(os.getpid(), signal.SIGKILL)
        store.save(_meta(2), step.model, step.optimizer, step.plan)
    finally:
        close_distributed()


@pytest.mark.slow
def test_a_kill_mid_save_leaves_the_previous_sharded_checkpoint_in_use(tmp_path):
    from training.run.store import read_tensors

    ckpt_dir = tmp_path / "checkpoints"
    with pytest.raises(Exception):  # rank 0 killed, rank 1 fails its next collective
        mp.spawn(_save_then_die_mid_save, args=(free_port(), str(ckpt_dir)), nprocs=WORLD, join=True)
    store = CheckpointStore(tmp_path)
    assert [p.name for p in store.list()] == ["step_00000001.dcp"]
    assert (ckpt_dir / "step_00000002.dcp.tmp" / "manifest.json").is_file()  # all written, never published
    path, state = store.latest()
    assert path.name == "step_00000001.dcp" and state["step"] == 1 and "model" not in state

    # One process reads the folder two ranks wrote: the whole weights, the moments by position.
    whole, full = read_tensors(path, state), torch.load(tmp_path / "full.pt", weights_only=True)
    assert whole["model"].keys() == full.keys()
    assert all(torch.equal(whole["model"][k], full[k]) for k in full)
    assert {k for m in whole["optimizer"]["state"].values() for k in m} == {"step", "exp_avg", "exp_avg_sq"}
    assert all(torch.isfinite(m["exp_avg"]).all() for m in whole["optimizer"]["state"].values())

    store.prune(keep=1, run_id="abc")   # the dead save's leftover goes with the next prune
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
    saved = CheckpointStore(fsdp_run).list()
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


def restarted_after_a_killed_rank(tmp_path: Path, overrides: list[str], restarts: int, after_rows: int) -> list[dict]:
    """torchrun --max-restarts=`restarts` over train.py `overrides` (run.dir=tmp_path/run), rank 1
    SIGKILLed once `after_rows` metric rows are logged: the run must finish (status 0). Returns
    lineage.jsonl's rows."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               f"--max-restarts={restarts}", str(REPO / "train.py"), *overrides]
    log = tmp_path / "torchrun.log"
    launcher = start(command, log)
    wait_for_rows(run_dir, after_rows, log, launcher)
    os.kill(worker_pids(launcher)[1], signal.SIGKILL)
    assert launcher.wait(timeout=180) == 0, tail(log)
    return [json.loads(line) for line in (run_dir / "lineage.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_max_restarts_after_a_killed_rank_continues_bit_identically(fsdp_run, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    rows = restarted_after_a_killed_rank(
        tmp_path, dist_overrides(run_dir, cache_dir, resume="auto", **{"trainer.parallel": "fsdp"}), 1, 10)
    assert losses(run_dir) == losses(fsdp_run)   # every logged value, each step once
    assert [r["event"] for r in rows] == ["start", "resume"] and rows[0]["run_id"] == rows[1]["run_id"]
    assert 4 <= rows[1]["step"] <= 12


@pytest.mark.slow
def test_max_restarts_after_a_rank_killed_before_the_first_checkpoint_finishes_the_run(single_run, tmp_path,
                                                                                        cache_dir):
    """Every restart used to refuse (metrics.jsonl but no checkpoint) until torchrun gave up: now the
    restarted workers start over from step 0 and keep the first attempt's rows aside."""
    run_dir = tmp_path / "run"
    rows = restarted_after_a_killed_rank(   # checkpoints at the end only
        tmp_path, dist_overrides(run_dir, cache_dir, resume="auto", **{"trainer.ckpt_every": 0}), 2, 3)
    assert_losses_close(losses(run_dir), losses(single_run))   # every step once, from step 1
    assert [(r["event"], r["step"]) for r in rows] == [("start", 0), ("restart", 0)], rows
    kept = [json.loads(line)["step"] for line in (run_dir / rows[1]["superseded"] / "metrics.jsonl").read_text().splitlines()]
    assert kept[:3] == [1, 2, 3] and kept == list(range(1, len(kept) + 1)) and len(kept) < STEPS


# ----------------------------------------------------------------------------- two torchrun agents: two "nodes"

NODES = 2


def start_two_nodes(tmp_path: Path, overrides: list[str], tag: str, *flags: str) -> tuple[list, list[Path]]:
    """Two torchrun agents (2 workers each) meeting through a c10d rendezvous on 127.0.0.1, each
    with its own token cache (a node's local disk). Node 0 must host the rendezvous store
    (is_host=1): a port taken between `free_port` and its bind fails it with EADDRINUSE, and only
    then is the whole launch retried on another port."""
    for attempt in range(3):
        port, agents, logs = free_port(), [], []
        for node in range(NODES):
            log = tmp_path / f"{tag}-node{node}.log"
            command = [sys.executable, "-m", "training.launch", f"--nnodes={NODES}", f"--nproc_per_node={WORLD}",
                       "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={tag}",
                       f"--rdzv_conf=is_host={int(node == 0)}", *flags, str(REPO / "train.py"), *overrides,
                       f"data.cache_dir={tmp_path / f'cache-node{node}'}"]
            agents.append(start(command, log, dict(subprocess_env(), LOGLEVEL="WARNING")))
            logs.append(log)
            if node == 0:
                deadline = time.monotonic() + 60
                while agents[0].poll() is None and time.monotonic() < deadline and not _listening(port):
                    time.sleep(0.05)
                if agents[0].poll() is not None and "EADDRINUSE" in logs[0].read_text() and attempt < 2:
                    break   # the port was taken: a new one
        else:
            return agents, logs
    raise AssertionError("unreachable")


def _listening(port: int) -> bool:
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def workers_of(agent: subprocess.Popen) -> dict[int, tuple[int, int]]:
    """global rank -> (local rank, pid) of an agent's workers (training.launch runs the agent in-process)."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    found = {}
    for pid in map(int, children):
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv)
        if "RANK" in env:
            found[int(env["RANK"])] = (int(env["LOCAL_RANK"]), pid)
    return found


@pytest.mark.slow
def test_two_nodes_train_as_one_stop_together_and_restart_after_a_kill(tmp_path, cache_dir):
    """4 ranks on 2 "nodes": one process's losses on the same global batch; SIGTERM to both agents
    stops every rank at one step with one checkpoint; a SIGKILLed worker of the second node (global
    rank 3, local rank 1) restarts both nodes' workers (--max-restarts) from the last checkpoint."""
    ranks = NODES * WORLD
    reference = tmp_path / "one"
    assert run_in_process(dist_overrides(reference, cache_dir, **{"trainer.grad_accum": ranks})) == 0
    run_dir = tmp_path / "run"
    overrides = [o for o in dist_overrides(run_dir, None, resume="auto", **{"trainer.grad_accum": ranks})
                 if not o.startswith("data.cache_dir=")]   # caches: per node, given by start_two_nodes

    agents, logs = start_two_nodes(tmp_path, overrides, "stop")
    wait_for_rows(run_dir, 6, logs[0], *agents)
    for agent in agents:
        agent.send_signal(signal.SIGTERM)
    assert [a.wait(timeout=120) for a in agents] == [143, 143], tail(logs[0]) + tail(logs[1])
    stopped_at = load_checkpoint(CheckpointStore(run_dir).list()[-1])["step"]   # saved where all stopped
    assert len(losses(run_dir)) == stopped_at >= 6
    for node, log in enumerate(logs):   # each node's local rank 0 built its cache, once; the same tokens
        assert log.read_text().count("tokenized ") == 1, tail(log)
    manifests = [json.loads(next((tmp_path / f"cache-node{n}" / "tokens").glob("*/manifest.json")).read_text())
                 for n in range(NODES)]
    assert manifests[0]["files"] == manifests[1]["files"]

    agents, logs = start_two_nodes(tmp_path, overrides, "kill", "--max-restarts=1")
    wait_for_rows(run_dir, stopped_at + 5, logs[0], *agents)
    second = workers_of(agents[1])
    victim = max(second)
    assert second[victim][0] != victim   # on the second node LOCAL_RANK differs from RANK
    os.kill(second[victim][1], signal.SIGKILL)
    assert [a.wait(timeout=180) for a in agents] == [0, 0], tail(logs[0]) + tail(logs[1])
    assert [r[0] for r in losses(run_dir)] == list(range(1, STEPS + 1))   # rank 0 alone wrote, each step once
    assert_losses_close(losses(run_dir), losses(reference))
    events = [json.loads(line)["event"] for line in (run_dir / "lineage.jsonl").read_text().splitlines()]
    assert events == ["start", "resume", "resume"]
