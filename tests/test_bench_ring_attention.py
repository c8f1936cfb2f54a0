"""scripts/bench/bench_ring_attention.py: its input checks and, on one gloo rank, its plumbing.

The real measurement needs torchrun on several GPUs; here a group of one CPU process runs the
--smoke path (the ring degenerates to one block, the plain formula in float32).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.spawned import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
import bench_ring_attention  # noqa: E402


@pytest.fixture
def one_rank(monkeypatch):
    port = free_port()
    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_needs_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="run under torchrun"):
        bench_ring_attention.main(["--smoke"])


def test_lengths_must_split_into_two_chunks_per_rank(one_rank, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--lengths: 6 is not a positive multiple of 2 x 2 ranks"):
        bench_ring_attention.main(["--smoke", "--lengths", "8,6"])


def test_smoke_writes_results_and_leaves_no_group(one_rank, tmp_path):
    report = bench_ring_attention.main(["--smoke", "--lengths", "16,32", "--out", str(tmp_path)])
    assert not dist.is_initialized()
    saved = json.loads((tmp_path / "ring_attention_cpu_x1.json").read_text())
    assert [row["tokens"] for row in saved["rows"]] == [16, 32] == [row["tokens"] for row in report["rows"]]
    assert all(row["ring_ms"] > 0 and row["one_gpu_ms"] > 0 for row in saved["rows"])
    assert "| 32 |" in (tmp_path / "ring_attention_cpu_x1.md").read_text()


def test_smoke_with_document_masks_reports_the_layout(one_rank, tmp_path):
    report = bench_ring_attention.main(["--smoke", "--lengths", "64", "--masks", "causal,docs-mixed,window-4k",
                                        "--out", str(tmp_path)])
    assert [row["mask"] for row in report["rows"]] == ["causal", "docs-mixed", "window-4k"]
    assert all(row["ring_tokens_per_s"] > 0 and row["imbalance"] >= 1 for row in report["rows"])
    assert report["rows"][2]["window"] == 16
    assert "| docs-mixed | 64 |" in (tmp_path / "ring_attention_cpu_x1_masked.md").read_text()


def test_unknown_mask_is_refused(one_rank):
    with pytest.raises(ValueError, match="--masks: 'docs-4k' is not one of"):
        bench_ring_attention.main(["--smoke", "--masks", "causal,docs-4k"])
