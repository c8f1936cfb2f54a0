"""tests/spawned.py: a rank killed by a signal is reported with the traceback faulthandler wrote for it."""
import ctypes
import os

import pytest
import torch.multiprocessing as mp

from tests.spawned import start_ranks


def _crash_in_rank_1(rank: int, out: str) -> None:
    open(os.path.join(out, f"ran{rank}"), "w").close()
    if rank == 1:
        ctypes.string_at(0)   # reads address 0: SIGSEGV


def _raise_in_rank_0(rank: int) -> None:
    if rank == 0:
        raise ValueError("rank 0's own error")


def test_a_rank_killed_by_a_signal_is_reported_with_where_it_was(tmp_path):
    with pytest.raises(AssertionError) as failure:
        start_ranks(_crash_in_rank_1, (str(tmp_path),), 2, tmp_path / "logs", start_method="fork")
    report = str(failure.value)
    assert "process 1 terminated with signal SIGSEGV" in report
    assert "--- rank1.faults" in report and "_crash_in_rank_1" in report and "rank0.faults" not in report
    assert (tmp_path / "ran0").exists() and (tmp_path / "ran1").exists()


def test_an_exception_in_a_rank_is_raised_as_torch_reports_it(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="rank 0's own error"):
        start_ranks(_raise_in_rank_0, (), 2, tmp_path, start_method="fork")
