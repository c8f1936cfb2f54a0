"""scripts/bench/bench_document_mask.py: the --smoke path end to end, and its pair counting."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
import bench_document_mask  # noqa: E402
from bench_document_mask import mixed_lengths, visible_pairs  # noqa: E402

from kernels.masks import visible_mask  # noqa: E402


def test_visible_pairs_count_the_mask():
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 1, 10]))[None]
    assert visible_pairs(16, [5, 1, 10], None) == visible_mask(16, 16, True, ids, None).sum().item()
    assert visible_pairs(16, [5, 1, 10], 3) == visible_mask(16, 16, True, ids, 3).sum().item()
    assert visible_pairs(16, None, 4) == visible_mask(16, 16, True, None, 4).sum().item()


def test_mixed_lengths_fill_the_window():
    lengths = mixed_lengths(65536)
    assert sum(lengths) == 65536 and min(lengths[:-1]) >= 16
    assert 1000 < 65536 / len(lengths) < 4000, "the mix should average about 2K tokens"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path")
def test_smoke_run_writes_results(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    try:
        report = bench_document_mask.main(["--smoke", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "document_mask_cpu.json").read_text())
    assert [r["case"] for r in data["results"]] == ["docs-2k", "docs-mixed", "window-4k"]
    for row in data["results"]:
        assert row["ours"]["status"] == "ok" and row["causal"]["status"] == "ok"
        assert row["flex"]["status"].startswith("error"), "Flex is not run on the CPU, and says so"
    # what each side builds from the mask: ours from document ids (window-4k has none), Flex not on the CPU
    assert [r["mask_build"]["ours"] is not None for r in data["results"]] == [True, True, False]
    assert all(r["mask_build"]["flex"] is None for r in data["results"])
    md = (tmp_path / "document_mask_cpu.md").read_text()
    assert "ours masked ms" in md and "FlexAttention is timed on CUDA only" in md and "mask build ms" in md
    assert report["results"][0]["documents"] == 4

    # one case on its own: the file keeps the other cases' rows, in the usual order
    try:
        bench_document_mask.main(["--smoke", "--out", str(tmp_path), "--cases", "window-4k"])
    finally:
        torch.set_num_threads(threads)
    again = json.loads((tmp_path / "document_mask_cpu.json").read_text())
    assert [r["case"] for r in again["results"]] == ["docs-2k", "docs-mixed", "window-4k"]
    assert again["results"][:2] == data["results"][:2]
    assert again["results"][2]["window"] == 32 and again["results"][2]["ours"]["status"] == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path")
def test_a_kernel_word_names_its_own_results(tmp_path):
    """--kernel runs ours under that word (a forward/backward pair too) into a file named for it;
    a word that cannot run says so in its row (the Gluon kernels need Hopper)."""
    threads = torch.get_num_threads()
    try:
        bench_document_mask.main(["--smoke", "--out", str(tmp_path), "--cases", "docs-mixed", "--kernel", "triton"])
        bench_document_mask.main(["--smoke", "--out", str(tmp_path), "--cases", "docs-mixed", "--kernel", "triton/gluon"])
    finally:
        torch.set_num_threads(threads)
    triton_row = json.loads((tmp_path / "document_mask_cpu_triton.json").read_text())
    assert triton_row["kernel"] == "triton" and triton_row["results"][0]["ours"]["status"] == "ok"
    pair = json.loads((tmp_path / "document_mask_cpu_triton-gluon.json").read_text())
    assert "needs a CUDA device" in pair["results"][0]["ours"]["status"]
    assert "Ours under kernel=triton/gluon" in (tmp_path / "document_mask_cpu_triton-gluon.md").read_text()
    assert not (tmp_path / "document_mask_cpu.json").exists()


def test_bad_heads_are_refused():
    with pytest.raises(ValueError, match="--heads"):
        bench_document_mask.main(["--smoke", "--heads", "12/5/64"])
    with pytest.raises(ValueError, match="--cases"):
        bench_document_mask.main(["--smoke", "--cases", "window-8k"])
