"""scripts/bench_generation.py --smoke: every measurement lands in the JSON and the Markdown."""
import json
import sys

import pytest
import torch

from tests.trainrun import REPO

sys.path.insert(0, str(REPO / "scripts"))

import bench_generation  # noqa: E402


def test_smoke_run_writes_decoding_and_prefill(tmp_path):
    result = bench_generation.main(["--smoke", "--attention", "sdpa", "--device", "cpu", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "generation_cpu.json").read_text())
    assert saved["decode"] == json.loads(json.dumps(result["decode"]))
    assert [(r["batch"], r["prompt_len"]) for r in saved["decode"]] == [(1, 64), (2, 64), (1, 128), (2, 128)]
    assert all("error" not in r and r["tokens_per_s"] > 0 and r["decode_steps"] == 4 for r in saved["decode"])
    (prefill,) = saved["prefill"]
    assert prefill["prompt_len"] == 256 and len(prefill["prefill_times_s"]) == 2 and prefill["prefill_s"] > 0
    assert {"date", "device", "torch", "triton", "git_commit"} <= set(saved["environment"])
    md = (tmp_path / "generation_cpu.md").read_text()
    assert "## Decoding" in md and "## Prefill" in md and md.count("| sdpa |") == 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_real_sizes_need_a_gpu(tmp_path):
    with pytest.raises(ValueError, match="no CUDA device"):
        bench_generation.main(["--out", str(tmp_path)])
