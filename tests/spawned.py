"""Start the ranks of a test of several processes, and say what a rank killed by a signal was doing.

Not a test module. A rank that dies of SIGSEGV or SIGABRT leaves pytest one line, "process 0
terminated with signal SIGSEGV" (seen once in CI, in tests/test_distributed.py, not reproduced in
60 runs here). Each rank started by `start_ranks` writes faulthandler's traceback of every thread
to `rank<N>.faults` in a folder of the test's, and a failure quotes those files.

The one suspect found: gloo's threads outlived destroy_process_group once FSDP2 or a
context-parallel mesh had run, and were torn down in interpreter shutdown, where gloo's teardown
had ended a rank with SIGABRT before (training/parallel/distributed.py, close_distributed, now
ends them first; tests/test_distributed.py and tests/test_context_parallel.py check it).
"""
from __future__ import annotations

import faulthandler
import socket
from pathlib import Path

import torch.multiprocessing as mp


def start_ranks(fn, args: tuple, nprocs: int, logs: str | Path, start_method: str = "spawn") -> None:
    """`fn(rank, *args)` in `nprocs` processes, joined; each rank's fatal-signal tracebacks in `logs`."""
    logs = Path(logs)
    logs.mkdir(parents=True, exist_ok=True)
    try:
        mp.start_processes(_rank, args=(fn, str(logs), args), nprocs=nprocs, join=True, start_method=start_method)
    except mp.ProcessExitedException as e:
        raise AssertionError(f"{e}\n{fault_report(logs)}") from None


def free_port() -> int:
    """A TCP port free on this host now, for a group's rendezvous (MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fault_report(logs: Path) -> str:
    """What faulthandler wrote for each rank that it wrote anything for."""
    found = [(p.name, p.read_text().strip()) for p in sorted(logs.glob("rank*.faults"))]
    parts = [f"--- {name}\n{text}" for name, text in found if text]
    return "\n".join(parts) if parts else "(no rank wrote a fatal-signal traceback)"


TASKS = Path("/proc/self/task")
LISTS_THREADS = TASKS.is_dir()   # Linux: every thread of the process, C++ ones included, by name


def gloo_threads() -> list[str]:
    """This process's gloo and TCPStore threads (none where LISTS_THREADS is false)."""
    names = [(t / "comm").read_text().strip() for t in TASKS.iterdir()] if LISTS_THREADS else []
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n)


def _rank(rank: int, fn, logs: str, args: tuple) -> None:
    faults = open(Path(logs) / f"rank{rank}.faults", "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.enable(file=faults, all_threads=True)
    fn(rank, *args)
