"""scripts/bench_train.py on the CPU: the bare step and train.py both run and land in the report."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_train  # noqa: E402


def test_smoke_run_reports_bare_and_real_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTRAIN_CACHE", str(tmp_path / "cache"))
    bench_train.main(["--smoke", "--attention", "sdpa", "--lengths", "64", "--tokens", "128", "--steps", "1",
                      "--warmup", "1", "--out", str(tmp_path), f"data.cache_dir={tmp_path / 'cache'}"])
    report = json.loads((tmp_path / "train_cpu_smoke.json").read_text())
    row, = report["rows"]
    assert row["real_status"] == "ok" and row["bare_tokens_per_s"] > 0 and row["real_tokens_per_s"] > 0
    assert "| sdpa | 64 | 2 |" in (tmp_path / "train_cpu_smoke.md").read_text()
