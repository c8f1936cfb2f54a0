"""scripts/bench/bench_parallel.py without GPUs: the summary of logged rows, the tables and the plot."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
import bench_parallel  # noqa: E402


def rows(rate: float, offset: float = 0.0) -> list[dict]:
    out = [{"step": s, "loss": 5.0 - s / 100 + offset, "lr": 1e-3, "tokens": s * 32768,
            "tokens_per_s": (rate / 10 if s == 5 else rate + s), "mfu": 0.3, "grad_norm": 1.0} for s in range(5, 105, 5)]
    out[9]["val_loss"] = 4.6
    return out


def test_summary_skips_the_compiling_steps_and_reports_the_speedup(tmp_path):
    one, two = bench_parallel.summarize(rows(100_000), warm=10), bench_parallel.summarize(rows(195_000, 1e-3), warm=10)
    assert one["tokens_per_s"] == pytest.approx(100_000 + 57.5) and one["tokens_per_step"] == 32768
    report = {"environment": {"device": "NVIDIA H200", "date": "d", "torch": "t", "triton": "x", "git_commit": "c"},
              "settings": {"gpus": 2, "warm": 10, "memory_steps": 3, "throughput_overrides": ["a=b"]},
              "throughput": [{"setup": "1 GPU", "gpus": 1, "exit_status": 0, **one},
                             {"setup": "2 GPUs, DDP", "gpus": 2, "exit_status": 0, **two},
                             {"setup": "2 GPUs, FSDP2", "gpus": 2, "exit_status": 1,
                              **bench_parallel.summarize([], warm=10)}],
              "memory": [{"parallel": "ddp", "gpus": 2, "exit_status": 0,
                          "ranks": [{"num_params": 5, "peak_allocated_bytes": 2**31, "peak_reserved_bytes": 2**32}] * 2},
                         {"parallel": "fsdp", "gpus": 2, "exit_status": 124}]}
    text = bench_parallel.markdown(report)
    assert "| 2 GPUs, DDP | 195,058 | 1.95x | 30.0% | 4.0010 | 50: 4.6000 |" in text
    assert "| 2 GPUs, FSDP2 | failed (1) |" in text and "| fsdp | 2 | - | failed (124) | - |" in text
    assert "| ddp | 2 | 5 | 2.0 / 2.0 | 4.0 / 4.0 |" in text
    bench_parallel.draw(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_bad_arguments_are_refused_before_any_run(tmp_path):
    with pytest.raises(ValueError, match="--out is required"):
        bench_parallel.main([])
    with pytest.raises(ValueError, match="--warm=50: must lie in"):
        bench_parallel.main(["--out", str(tmp_path), "--steps", "40", "--warm", "50"])
