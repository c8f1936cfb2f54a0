"""scripts/bench/compare_attention_losses.py: comparison, summary and plot on synthetic metrics files (no training)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
import compare_attention_losses as cal  # noqa: E402


def write_run(run_dir: Path, losses: list[float], val: dict[int, float]) -> Path:
    """A run folder as train.py leaves it: metrics.jsonl (one row per step) and config.yaml."""
    run_dir.mkdir(parents=True)
    rows = [{"step": i + 1, "loss": loss, "lr": 1e-3, "tokens": 64 * (i + 1), "tokens_per_s": 1.0, "grad_norm": 1.0}
            | ({"val_loss": val[i + 1]} if i + 1 in val else {}) for i, loss in enumerate(losses)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.yaml").write_text("seed: 7\ndevice: cpu\nmodel:\n  name: tiny\n")
    return run_dir


BASE = [5.0 - 0.1 * i for i in range(12)]
# steps 1-2 identical, then differences of 1e-6 * step: the early window (10 steps) ends at 1e-5, step 12 at 1.2e-5
OTHER = [loss + (0.0 if i < 2 else 1e-6 * (i + 1)) for i, loss in enumerate(BASE)]


@pytest.fixture
def runs(tmp_path):
    return {"naive": write_run(tmp_path / "naive", BASE, {6: 4.5, 12: 4.0}),
            "flash": write_run(tmp_path / "flash", OTHER, {6: 4.5, 12: 4.0 + 3e-6})}


def test_compare_reports_early_and_overall_differences(runs):
    diff = cal.compare(cal.read_series(runs["naive"]), cal.read_series(runs["flash"]))
    assert diff["identical_steps"] == 2
    assert diff["early"]["steps"] == 10 and diff["all"]["steps"] == 12
    assert diff["early"]["max_abs_diff"] == pytest.approx(1e-5, rel=1e-6)
    assert diff["early"]["mean_abs_diff"] == pytest.approx(sum(range(3, 11)) * 1e-6 / 10, rel=1e-6)
    assert diff["all"]["max_abs_diff"] == diff["final_abs_diff"] == pytest.approx(1.2e-5, rel=1e-6)
    assert diff["val_abs_diff"][6] == 0 and diff["val_abs_diff"][12] == pytest.approx(3e-6, rel=1e-6)


def test_compare_refuses_runs_that_logged_different_steps(tmp_path, runs):
    short = cal.read_series(write_run(tmp_path / "short", BASE[:5], {}))
    with pytest.raises(ValueError, match="different steps"):
        cal.compare(cal.read_series(runs["naive"]), short)


def test_outputs_hold_both_series_the_differences_and_metadata(tmp_path, runs):
    result = cal.build_result(["naive", "flash"], ["trainer.max_steps=12"], runs, {"naive": 1.0, "flash": 9.0})
    cal.write_outputs(result, tmp_path / "out" / "parity")

    saved = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert saved["series"]["flash"]["loss"] == OTHER and saved["series"]["naive"]["val_loss"] == {"6": 4.5, "12": 4.0}
    assert saved["comparison"]["all"]["max_abs_diff"] == pytest.approx(1.2e-5, rel=1e-6)
    assert saved["seed"] == 7 and saved["overrides"] == ["trainer.max_steps=12"]
    assert {"date", "device", "torch", "triton", "git_commit"} <= saved["environment"].keys()
    summary = (tmp_path / "out" / "parity.md").read_text()
    assert "| first 10 steps | 1e-05 |" in summary and "| all 12 steps | 1.2e-05 |" in summary
    assert "| final step (12) | 1.2e-05 |" in summary
    assert "2 of 12 steps had bit-identical losses" in summary
    assert (tmp_path / "out" / "parity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_redraw_rewrites_the_summary_and_plot_from_the_saved_json(tmp_path, runs):
    stem = tmp_path / "parity"
    cal.write_outputs(cal.build_result(["naive", "flash"], [], runs, {"naive": 1.0, "flash": 9.0}), stem)
    summary = stem.with_suffix(".md").read_text()
    stem.with_suffix(".md").unlink()
    stem.with_suffix(".png").unlink()
    cal.main(["--redraw", str(stem.with_suffix(".json"))])
    assert stem.with_suffix(".md").read_text() == summary
    assert stem.with_suffix(".png").stat().st_size > 0


def test_plot_of_bit_identical_runs_draws_without_a_log_axis(tmp_path):
    same = {name: write_run(tmp_path / name, BASE[:3], {3: 4.8}) for name in ("naive", "flash")}
    result = cal.build_result(["naive", "flash"], [], same, {"naive": 1.0, "flash": 1.0})
    assert result["comparison"]["all"]["max_abs_diff"] == 0
    cal.draw(result, tmp_path / "same.png")
    assert (tmp_path / "same.png").stat().st_size > 0


def test_overrides_are_shared_defaults_fill_gaps_and_per_run_keys_are_refused():
    assert cal.run_overrides(["trainer.max_steps=5"]) == [*cal.DEFAULT_OVERRIDES, "trainer.max_steps=5"]
    assert cal.run_overrides(["trainer.log_every=10"]) == ["trainer.progress=false", "trainer.log_every=10"]
    with pytest.raises(ValueError, match="attention="):
        cal.run_overrides(["attention=sdpa"])
    with pytest.raises(ValueError, match="run.dir="):
        cal.run_overrides(["run.dir=/tmp/x"])


def test_existing_run_dir_stops_the_script_before_training(tmp_path):
    (tmp_path / "naive").mkdir()
    with pytest.raises(SystemExit, match="already exists"):
        cal.main(["--work", str(tmp_path), "trainer.max_steps=1"])


def test_attention_takes_two_names_comma_separated():
    """--attention BASE,OTHER: one spelling for the implementation(s) across the tools."""
    with pytest.raises(ValueError, match="name two different implementations"):
        cal.main(["--attention", "naive,flash,sdpa"])
    with pytest.raises(ValueError, match="name two different implementations"):
        cal.main(["--attention", "flash,flash"])
