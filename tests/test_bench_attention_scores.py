"""scripts/bench/bench_attention_scores.py: the --smoke path end to end (the GPU run is the benchmark)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
import bench_attention_scores  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path")
def test_smoke_run_writes_every_case_and_its_ratio(tmp_path):
    threads = torch.get_num_threads()
    try:
        bench_attention_scores.main(["--smoke", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "attention_scores_cpu.json").read_text())
    assert [(r["case"], r["kernel"]) for r in data["results"]] == [
        (case, word) for case in bench_attention_scores.CASES for word in bench_attention_scores.WORDS
        if word != "sdpa" or case in ("none", "dropout")]   # SDPA has no soft-capping or sinks
    for row in data["results"]:
        assert row["status"] == "ok", row
        assert row["fwd+bwd_ms"] > 0 and row["x_none"] > 0 and row["host_ms"] > 0
        assert row["plan"].startswith("PyTorch's SDPA" if row["kernel"] == "sdpa" else "forward=triton")
    assert all(r["x_none"] == 1.0 for r in data["results"] if r["case"] == "none")
    md = (tmp_path / "attention_scores_cpu.md").read_text()
    assert "| dropout | auto |" in md and "<= 1.25x |" in md and "x none" in md   # no verdict on a CPU
    assert "host ms" in md and "(host-bound)" not in md


def test_rows_whose_host_time_nears_the_gpu_time_are_marked():
    """A GPU row whose host time per call reaches HOST_BOUND of its forward+backward says so."""
    base = {"case": "sinks", "kernel": "auto", "status": "ok", "plan": "p", "fwd_ms": 0.3, "bwd_ms": 0.7, "x_none": 1.0}
    slow = dict(base, **{"fwd+bwd_ms": 1.0, "host_ms": bench_attention_scores.HOST_BOUND * 1.0})
    fast = dict(base, **{"fwd+bwd_ms": 1.0, "host_ms": 0.4})
    table = bench_attention_scores.rows([slow, fast])
    assert [row[6] for row in table] == ["0.800 (host-bound)", "0.400"]
    assert bench_attention_scores.rows([slow], judged=False)[0][6] == "0.800"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_a_real_run_needs_a_gpu(tmp_path):
    with pytest.raises(ValueError, match="no CUDA device"):
        bench_attention_scores.main(["--out", str(tmp_path)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path")
def test_switches_set_code_paths_and_name_them(tmp_path, monkeypatch):
    """--switches sets the named code paths for the run and names them in the file and its text; an
    unknown one, or both settings of one path, is refused before anything runs."""
    from kernels import exp2, scores

    monkeypatch.setattr(scores, "PACKED_DROPOUT", True)
    monkeypatch.setattr(scores, "SOFTCAP_FIXED_SHIFT", True)
    monkeypatch.setattr(exp2, "ON_FMA", {})
    threads = torch.get_num_threads()
    try:
        bench_attention_scores.main(["--smoke", "--cases", "dropout", "--words", "triton",
                                     "--switches", "unpacked-dropout,exp2-fma,softcap-running-max", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert not scores.PACKED_DROPOUT and exp2.ON_FMA == exp2.CANDIDATES and not scores.SOFTCAP_FIXED_SHIFT
    stem = tmp_path / "attention_scores_cpu_unpacked-dropout_exp2-fma_softcap-running-max"
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["switches"] == ["unpacked-dropout", "exp2-fma", "softcap-running-max"]
    assert all(r["status"] == "ok" for r in data["results"])
    assert "Switched: the forwards' dropout mask as a float32 select" in stem.with_suffix(".md").read_text()
    with pytest.raises(ValueError, match="--switches: fast not among"):
        bench_attention_scores.main(["--smoke", "--switches", "fast", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="exclude each other"):
        bench_attention_scores.main(["--smoke", "--switches", "packed-dropout,unpacked-dropout", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="exp2-fma and exp2-off exclude each other"):
        bench_attention_scores.main(["--smoke", "--switches", "exp2-fma,exp2-off", "--out", str(tmp_path)])
    bench_attention_scores.set_switches(["exp2-off"])   # the A/B's other arm: every exponential on ex2
    assert exp2.ON_FMA == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal of the flex word")
def test_flex_times_none_and_softcap_and_says_why_not_on_a_cpu(tmp_path):
    """--words flex (FlexAttention, the cap as its score_mod) runs for none and softcap only, and on a
    CPU, where flex has no backward, each row says so instead of a time."""
    threads = torch.get_num_threads()
    try:
        bench_attention_scores.main(["--smoke", "--cases", "dropout,softcap", "--words", "auto,flex",
                                     "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "attention_scores_cpu.json").read_text())
    assert [(r["case"], r["kernel"]) for r in data["results"]] == [
        ("none", "auto"), ("none", "flex"), ("dropout", "auto"), ("softcap", "auto"), ("softcap", "flex")]
    flex = [r for r in data["results"] if r["kernel"] == "flex"]
    assert all("no backward on a CPU" in r["status"] and "fwd+bwd_ms" not in r for r in flex)
    assert "- softcap (flex): error: ValueError: FlexAttention has no backward on a CPU" in \
        (tmp_path / "attention_scores_cpu.md").read_text()


def test_flex_word_hands_back_the_kernels_layout(monkeypatch):
    """The flex word's output is (B, N, H, D) like the kernels', so the timer's gradient fits it (flex
    itself works in (B, H, N, D)); a stand-in for the compiled flex runs it on a CPU."""
    from types import SimpleNamespace

    import bench_attention
    from kernels.reference import attention_reference

    def capped_sdpa(causal, seq_len, device, score_mod=None):
        assert causal and seq_len == 16 and score_mod is not None
        def flex_layout(q, k, v):   # (B, H, N, D) in and out, as flex_attention
            bnhd = (t.transpose(1, 2) for t in (q, k, v))
            return attention_reference(*bnhd, causal=True, softcap=30.0).transpose(1, 2)
        return flex_layout

    monkeypatch.setattr(bench_attention, "_flex", capped_sdpa)
    q, k, v = (torch.randn(2, 16, 3, 8, dtype=torch.float64) for _ in range(3))
    out = bench_attention_scores._flex_attention(q, k, v, 30.0, SimpleNamespace(type="cuda"))()
    assert out.shape == q.shape
    torch.testing.assert_close(out, attention_reference(q, k, v, causal=True, softcap=30.0))
