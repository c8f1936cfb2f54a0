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
