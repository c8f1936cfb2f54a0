"""scripts/bench/bench_ring_balance.py: its tile count and mixes, and the --smoke path end to end."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
import bench_ring_balance  # noqa: E402
from bench_ring_balance import document_lengths, tiles_visited  # noqa: E402

from kernels.masks import document_bounds  # noqa: E402
from model.cp_layout import balanced_layout, visible_keys  # noqa: E402
from model.ring_attention import RingStep, masked_steps  # noqa: E402


def test_mixes_fill_the_window():
    for mix in ("docs-2k", "docs-mixed"):
        for seq_len in (1000, 65536, 131072):
            lengths = document_lengths(mix, seq_len, seed=3)
            assert sum(lengths) == seq_len and min(lengths) >= 1, (mix, seq_len)


def test_tiles_visited_lie_between_the_tiles_with_a_visible_pair_and_the_whole_block():
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([100, 37, 300, 5, 70]))[None]
    starts = document_bounds(ids)[:, 0].long()
    layout = balanced_layout(visible_keys(starts, 512, None), 2)
    for rank in range(2):
        for step in masked_steps(layout, rank, starts, 48, "cpu"):
            if step is None:
                continue
            rows, cols = step.rows.stop - step.rows.start, step.cols.stop - step.cols.start
            box = -(-rows // 16) * -(-cols // 16)
            if step.key_bounds is None:
                assert tiles_visited(step, 16, 16) == box
                continue
            lo, hi = step.key_bounds[0]
            key = torch.arange(cols)
            seen = (key[None] >= lo[:, None]) & (key[None] < hi[:, None])
            padded = torch.nn.functional.pad(seen, (0, -cols % 16, 0, -rows % 16))
            with_pairs = int(padded.view(padded.shape[0] // 16, 16, -1, 16).any(3).any(1).sum())
            assert with_pairs <= tiles_visited(step, 16, 16) <= box
    assert tiles_visited(RingStep(slice(0, 33), slice(0, 16)), 16, 16) == 3


def test_smoke_run_writes_results(tmp_path):
    report = bench_ring_balance.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "ring_balance_cpu.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    mixed = [r for r in saved["rows"] if r["mix"] == "docs-mixed"]
    assert mixed and all(r["balanced"]["pairs_max"] <= r["zigzag"]["pairs_max"] for r in mixed)
    assert all(r["balanced"]["pairs_max"] < 1.2 for r in saved["rows"])
    assert "| docs-mixed | 1K | 4 | 2 |" in (tmp_path / "ring_balance_cpu.md").read_text()


def test_bad_windows_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--windows 0: must be a positive integer"):
        bench_ring_balance.main(["--smoke", "--windows", "0", "--out", str(tmp_path)])
    assert not (tmp_path / "ring_balance_cpu.json").exists()
