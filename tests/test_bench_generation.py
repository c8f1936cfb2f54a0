"""scripts/bench/bench_generation.py --smoke: every measurement lands in the JSON and the Markdown, every
mode decodes the same greedy tokens, and what cannot run on the device is left out with a note."""
import json
import sys

import pytest
import torch

from tests.trainrun import REPO

sys.path.insert(0, str(REPO / "scripts" / "bench"))

import bench_generation  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine leaves out")
def test_smoke_run_writes_decoding_and_prefill(tmp_path, monkeypatch):
    import model.attention
    monkeypatch.setattr(model.attention, "INTERPRET", False)   # a plain CPU machine: no Triton interpreter
    result = bench_generation.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "generation_cpu.json").read_text())
    assert saved["decode"] == json.loads(json.dumps(result["decode"]))
    # flash and the CUDA graph are left out with a note, not an error row
    assert saved["modes"] == ["eager", "static"] and len(saved["notes"]) == 2, saved["notes"]
    assert [(r["attention"], r["mode"], r["batch"], r["prompt_len"]) for r in saved["decode"]] == [
        ("sdpa", mode, b, n) for n in (64, 128) for b in (1, 2) for mode in ("eager", "static")]
    assert all("error" not in r and r["tokens_per_s"] > 0 and r["decode_steps"] == 4 for r in saved["decode"])
    # the static cache's greedy tokens are the eager cache's, on the same prompts
    assert [r.get("same_tokens_as_eager") for r in saved["decode"] if r["mode"] == "static"] == [1.0] * 4
    (prefill,) = saved["prefill"]
    assert prefill["prompt_len"] == 256 and len(prefill["prefill_times_s"]) == 2 and prefill["prefill_s"] > 0
    assert {"date", "device", "torch", "triton", "git_commit"} <= set(saved["environment"])
    md = (tmp_path / "generation_cpu.md").read_text()
    assert "## Decoding" in md and "## Prefill" in md and md.count("| sdpa |") == 9
    assert "flash left out" in md and "graph mode left out" in md and "Error" not in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_real_sizes_need_a_gpu(tmp_path):
    with pytest.raises(ValueError, match="no CUDA device"):
        bench_generation.main(["--out", str(tmp_path)])


def test_bad_modes_and_an_output_file_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="--modes: 'fast' is not a decode mode"):
        bench_generation.main(["--smoke", "--modes", "fast", "--out", str(tmp_path)])
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        bench_generation.main(["--smoke", "--out", str(tmp_path / "file")])
