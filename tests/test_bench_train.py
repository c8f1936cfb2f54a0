"""scripts/bench/bench_train.py on the CPU: the bare step and train.py both run and land in the report."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
import bench_train  # noqa: E402


def test_smoke_run_reports_bare_and_real_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTRAIN_CACHE", str(tmp_path / "cache"))
    bench_train.main(["--smoke", "--attention", "sdpa", "--lengths", "64", "--tokens", "128", "--steps", "1",
                      "--warmup", "1", "--out", str(tmp_path), f"data.cache_dir={tmp_path / 'cache'}"])
    report = json.loads((tmp_path / "train_cpu_smoke.json").read_text())
    row, = report["rows"]
    assert row["real_status"] == "ok" and row["bare_tokens_per_s"] > 0 and row["real_tokens_per_s"] > 0
    assert "| sdpa | 64 | 2 |" in (tmp_path / "train_cpu_smoke.md").read_text()


def test_smoke_ablation_adds_each_loop_piece_to_the_same_step(tmp_path, monkeypatch):
    """The ablation's rows are the bare step plus the loop's pieces one at a time, in order."""
    monkeypatch.setenv("FLASHTRAIN_CACHE", str(tmp_path / "cache"))
    bench_train.main(["--smoke", "--ablation", "--attention", "sdpa", "--ablation-len", "64", "--tokens", "128",
                      "--steps", "1", "--warmup", "1", "--out", str(tmp_path), f"data.cache_dir={tmp_path / 'cache'}"])
    rows = json.loads((tmp_path / "train_cpu_smoke_ablation.json").read_text())["ablation"]["rows"]
    assert [r["features"] for r in rows] == list(bench_train.ABLATION)
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_a_token_count_that_is_not_a_multiple_of_a_length_is_noted():
    """A step holds whole sequences: --tokens 10000 at T=3000 trains 9,000 a step, and says so."""
    assert bench_train.rounding_notes(10000, [1000, 3000, 3000, 4096]) == [
        "--tokens 10000 at T=3000: 3 sequence(s) a step, 9000 tokens",
        "--tokens 10000 at T=4096: 2 sequence(s) a step, 8192 tokens"]
    assert bench_train.rounding_notes(16384, [1024, 4096]) == []
