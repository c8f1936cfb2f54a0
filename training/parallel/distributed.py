"""Several processes through `torchrun`: the process group, the mesh, collectives, agreed stops.

`torchrun --nproc_per_node=N train.py ...` sets RANK, WORLD_SIZE and LOCAL_RANK; `init_distributed`
reads them and joins the process group (NCCL on CUDA, gloo on the CPU) with a bounded timeout, so
a rank that dies makes the others fail within `trainer.dist_timeout_s` instead of hanging. Without
those variables (or with WORLD_SIZE=1) the run is a single process and nothing here does any work.

With `trainer.context_parallel=C` the N processes form a 2-D DeviceMesh (dp = N / C, cp = C;
ranks dp_rank * C .. dp_rank * C + C - 1 are one CP group, neighbours on a node). What the run
does with them (DDP or FSDP2, the ring) is the parallel plan's (training.parallel.plan).
"""
from __future__ import annotations

import datetime
import functools
import gc
import importlib
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from training.process.exits import FINISHED, stopped_by


@dataclass
class DistEnv:
    """Where this process sits among the run's processes (rank 0 of 1 without torchrun)."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    control: object = None  # a gloo group for host-side agreement (stop requests); None when alone
    cp_size: int = 1        # trainer.context_parallel: ranks that split one sequence
    cp_group: object = None  # this rank's context-parallel process group (None when cp_size is 1)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def dp_size(self) -> int:
        """Data-parallel size: groups of ranks that read different windows."""
        return self.world_size // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) without it."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers (as torchrun sets them): {e}") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} must lie in [0, WORLD_SIZE={world})")
    return rank, world, local


class RankError(ValueError):
    """Bad input seen by one rank only (its device, its environment): every rank reports its own."""


def check_launcher(world: int) -> None:
    """Several processes only under torchrun: RANK/WORLD_SIZE left in a shell's environment would
    make a lone process wait up to trainer.dist_timeout_s for peers that never come."""
    from training.process.signals import launched_by_torchrun

    if world > 1 and not launched_by_torchrun():
        raise RankError(f"WORLD_SIZE={world} (RANK={os.environ.get('RANK')}) is set, but this process was not "
                        f"started by torchrun: unset WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT "
                        f"to train in one process, or launch with torchrun")


def local_grad_accum(grad_accum: int, world_size: int, context_parallel: int = 1) -> int:
    """Micro-batches per rank per optimizer step: the global batch (batch_size x grad_accum
    sequences) stays what the config says, whatever the number of processes; the C ranks of a
    context-parallel group share each of their micro-batches."""
    dp = world_size // context_parallel
    if grad_accum % dp:
        who = (f"{world_size} processes" if context_parallel == 1 else
               f"{dp} data-parallel groups ({world_size} processes / trainer.context_parallel={context_parallel})")
        raise ValueError(f"trainer.grad_accum={grad_accum} is not divisible by the {who}: "
                         f"the global batch is trainer.batch_size x trainer.grad_accum sequences; set "
                         f"trainer.grad_accum to a multiple of {dp}")
    return grad_accum // dp


def init_distributed(device_type: str, timeout_s: float, context_parallel: int = 1) -> DistEnv:
    """Join torchrun's process group (a no-op for a single process); CUDA ranks get their own GPU;
    with context_parallel = C > 1 also the (dp, cp) mesh and this rank's CP group."""
    from training.parallel.context import check_processes

    rank, world, local = env_world()
    check_processes(context_parallel, world)
    if world == 1:
        return DistEnv()
    if device_type == "cuda":
        if local >= torch.cuda.device_count():
            raise RankError(f"LOCAL_RANK={local} but this node has {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(local)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        store = restart_safe_store(world, timeout)
        dist.init_process_group(backend=backend, timeout=timeout, store=store,
                                rank=rank if store else -1, world_size=world if store else -1,
                                device_id=torch.device("cuda", local) if device_type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=timeout) if device_type == "cuda" else dist.group.WORLD
    cp_group = context_parallel_group(device_type, world, context_parallel, timeout) if context_parallel > 1 else None
    return DistEnv(rank, world, local, control, context_parallel, cp_group)


def restart_safe_store(world: int, timeout: datetime.timedelta):
    """torchrun's own key-value store, under a prefix of its own for each round of workers; None
    when torchrun does not share its store (then the process group makes a new one, as usual).

    The workers of every round (`--max-restarts`) meet in the same store of the agent, and the
    process group's keys carry no round: a restarted rank could read the address a killed rank of
    the last round published, and fail connecting to it (seen with gloo: "Connection refused").
    Each worker counts itself in once; all of a round join before any of the next one starts
    (the agents stop every worker first), so the count says the round on every node alike.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    joined = store.add("flashtrain/workers_joined", 1)
    return dist.PrefixStore(f"flashtrain/round_{(joined - 1) // world}", store)


def context_parallel_group(device_type: str, world: int, size: int, timeout: datetime.timedelta):
    """This rank's CP group, the `cp` dimension of a (dp, cp) DeviceMesh, with the run's timeout
    (so a dead rank in the ring fails the others within trainer.dist_timeout_s as well)."""
    from torch.distributed.device_mesh import init_device_mesh

    options = (dist.ProcessGroupNCCL.Options() if device_type == "cuda"
               else torch._C._distributed_c10d.ProcessGroupGloo._Options())
    options._timeout = timeout
    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("dp", "cp"),
                            backend_override={"cp": options})
    group = mesh.get_group("cp")
    if dist.get_rank(group) != dist.get_rank() % size:  # model.context_parallel's chunk order
        raise RuntimeError(f"rank {dist.get_rank()} is rank {dist.get_rank(group)} of its CP group, expected "
                           f"{dist.get_rank() % size}")
    return group


def close_distributed() -> None:
    """Leave the process group, if this process joined one.

    Garbage is collected first. A DDP or FSDP2 model that its caller has let go of can still be
    alive in a reference cycle (FSDP2's states and parameter groups always are), and it holds the
    process group and, on gloo, work objects whose tensors refer back to Python. Collected here,
    they go while the group is alive; left to a later GC pass, they went after the group's
    destruction or during interpreter shutdown, where gloo's teardown aborted the process now and
    then (`terminate called without an active exception`, SIGABRT, seen in the CPU tests).

    DTensor's caches are emptied before that (`release_dtensor_caches`): they keep each DeviceMesh
    that FSDP2 or context parallelism used, a mesh keeps its process groups, and so the groups
    outlived destroy_process_group and gloo's threads ran on into interpreter shutdown.
    """
    if dist.is_available() and dist.is_initialized():
        release_dtensor_caches()
        gc.collect()
        dist.destroy_process_group()


DTENSOR_CACHES = (  # (module, attribute path): torch 2.13's caches of torch.distributed.tensor that hold meshes
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),   # the operators' sharding propagation
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)


def release_dtensor_caches() -> None:
    """Empty DTensor's caches of meshes. They are torch's private caches: one that another torch
    release lacks is passed over, and tests/test_distributed.py fails if gloo's threads outlive the
    group again (a cache this list does not name)."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor in this process: nothing cached
        return
    for module, path in DTENSOR_CACHES:
        try:
            functools.reduce(getattr, path.split("."), importlib.import_module(module))()
        except (ImportError, AttributeError):
            continue


def all_reduce(tensor: torch.Tensor, env: DistEnv, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place over all ranks (nothing when alone)."""
    if env.enabled:
        dist.all_reduce(tensor, op=op)
    return tensor


def barrier(env: DistEnv) -> None:
    if env.enabled:
        dist.barrier(group=env.control)


class AgreedStop:
    """A stop request seen by any rank, agreed by all at the same step boundary.

    Each boundary starts a non-blocking all-reduce (MAX) of this rank's signal number on the gloo
    control group and reads the one started at the previous boundary: a request is acted on one
    step after it arrives, on every rank at once, without a host-device sync per step. Alone, the
    local request is the answer at once. Cost: host time only, 0.2-1 ms per step measured with 2
    gloo ranks on a busy 2-core CPU (mostly enqueuing the all-reduce; the wait finds it done).
    """

    def __init__(self, env: DistEnv, stop) -> None:
        self.env, self.stop = env, stop
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._work = None
        self.signum: int | None = None  # the agreed signal (the local one when alone)

    def poll(self) -> bool:
        if not self.env.enabled:
            self.signum = self.stop.signum
            return self.signum is not None
        if self._work is not None:
            self._work.wait()
            if int(self._flag[0]):
                self.signum = int(self._flag[0])
                self._work = None
                return True
        self._flag[0] = self.stop.signum or 0
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.env.control, async_op=True)
        return False

    def finish(self) -> None:
        """Complete the all-reduce in flight, so every rank issued the same collectives."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    @property
    def exit_code(self) -> int:
        return stopped_by(self.signum) if self.signum else FINISHED
