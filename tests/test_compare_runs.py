"""scripts/compare_runs.py on two tiny runs (as folders and as a sweep), and the table a sweep prints."""
import shutil
import subprocess
import sys

import pytest

from tests.trainrun import REPO, cache_dir, run_in_process, subprocess_env, tiny_overrides  # noqa: F401

sys.path.insert(0, str(REPO / "scripts"))

import compare_runs  # noqa: E402


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, cache_dir):  # noqa: F811
    sweep = tmp_path_factory.mktemp("sweep")
    for job, lr in (("0", 1e-3), ("1", 3e-3)):
        overrides = tiny_overrides(sweep / job, cache_dir, steps=4, **{"trainer.eval_every": 2, "optim.lr": lr})
        assert run_in_process(overrides) == 0
    return sweep


def test_table_and_png_from_two_runs(two_runs, tmp_path):
    result = compare_runs.main([str(two_runs / "0"), str(two_runs / "1"), "--out", str(tmp_path), "--name", "c"])
    assert result["keys"] == ["optim.lr"]   # the one config difference (run.dir never counts)
    assert result["headers"] == ["run", "optim.lr", "steps", "tokens", "train loss", "val loss", "best val (step)",
                                 "tokens/s"]
    (a, b) = result["rows"]
    assert a[1:4] == ["0.001", "4", "1,024"] and b[1:4] == ["0.003", "4", "1,024"]
    assert all(cell != "-" for cell in a + b) and a[4] != b[4]   # both have losses, and they differ
    saved = __import__("json").loads((tmp_path / "c.json").read_text())
    assert saved["rows"] == result["rows"] and [len(r["metrics"]) for r in saved["runs"]] == [4, 4]
    assert {"date", "git_commit", "torch"} <= set(saved["environment"])
    md = (tmp_path / "c.md").read_text()
    assert "| optim.lr |" in md and md.count("| 0.00") == 2
    png = tmp_path / "c.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_folder_lists_its_jobs_in_order(two_runs, tmp_path):
    sweep = tmp_path / "sweep"
    for job in ("1", "0"):
        shutil.copytree(two_runs / job, sweep / job)
    (sweep / "multirun.yaml").write_text("{}\n")   # what Hydra leaves beside the jobs
    result = compare_runs.main([str(sweep), "--out", str(tmp_path)])
    assert [row[0] for row in result["rows"]] == ["0", "1"]


def test_bad_arguments_are_one_line_before_any_output(two_runs, tmp_path):
    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    for argv, message in (([str(tmp_path / "gone")], "no such run folder"),
                          ([str(not_a_run)], "is neither a run folder"),
                          ([str(two_runs / "0"), "--out", str(two_runs / "0" / "config.yaml")], "is a file, not a folder")):
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_runs.py"), *argv], cwd=REPO,
                              env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_sweep_prints_its_table_when_it_ends(tmp_path, cache_dir):  # noqa: F811
    overrides = [o for o in tiny_overrides(tmp_path, cache_dir, steps=2) if not o.startswith("run.dir=")]
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "optim.lr=0.001,0.002", *overrides,
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tail = proc.stdout[proc.stdout.index("sweep sweep: 2 job(s)"):].splitlines()   # paths relative to the cwd
    assert tail[1].split() == ["run", "optim.lr", "steps", "tokens", "train", "loss", "val", "loss", "best", "val",
                               "(step)", "tokens/s"]
    assert [line.split()[:2] for line in tail[3:5]] == [["0", "0.001"], ["1", "0.002"]]
    assert tail[5].startswith("curves: python ") and tail[5].endswith("compare_runs.py sweep")


def test_keys_that_change_nothing_are_not_listed_as_differences(tmp_path):
    from training.run.records import RunRecord, differing_keys

    common = {"model.n_layer": 2, "run.name": None}
    a = RunRecord(tmp_path / "a", {**common, "optim.lr": 1e-3, "resume": None, "allow_changes": None,
                                   "trainer.progress": True, "trainer.ckpt_every": 100, "trainer.keep_ckpts": 2,
                                   "data.cache_dir": "/home/a/.cache/flashtrain", "run.dir": "a"}, [])
    b = RunRecord(tmp_path / "b", {**common, "optim.lr": 3e-3, "resume": "auto", "allow_changes": ["trainer"],
                                   "trainer.progress": False, "trainer.ckpt_every": 10, "trainer.keep_ckpts": 5,
                                   "data.cache_dir": "/tmp/cache", "run.dir": "b"}, [])
    assert differing_keys([a, b]) == ["optim.lr"]


def test_the_legend_covers_neither_panel(tmp_path, monkeypatch):
    from training.run.records import RunRecord

    runs = [RunRecord(tmp_path / f"job{i}", {"optim.lr": i * 1e-4, "model.name": "a-long-model-name"},
                      [{"step": s, "tokens": 256 * s, "loss": 5.0 - 0.1 * s - 0.01 * i,
                        **({"val_loss": 5.1 - 0.1 * s} if s % 2 == 0 else {})} for s in range(1, 9)])
            for i in range(12)]
    figures = []
    monkeypatch.setattr(compare_runs, "save_figure", lambda fig, path: figures.append(fig))
    compare_runs.plot(runs, ["optim.lr"], tmp_path / "c.png", "12 runs")
    fig = figures[0]
    fig.canvas.draw()
    panels = fig.axes
    assert len(panels) == 2 and all(ax.get_legend() is None for ax in panels)
    (legend,) = fig.legends
    assert len(legend.get_texts()) == 12
    box = legend.get_window_extent()
    assert not any(box.overlaps(ax.get_window_extent()) for ax in panels)


def test_runs_that_differ_in_many_keys_keep_their_legend_inside_the_figure(tmp_path, monkeypatch):
    """Two recipes differ in a dozen keys: each legend entry names three and counts the rest, so the
    figure stays its width (it had grown to 5,788 pixels for three runs); the table keeps them all."""
    from training.run.records import RunRecord, run_label

    keys = [f"data.passkey.key_{k}" for k in range(11)]
    runs = [RunRecord(tmp_path / f"run{i}", {k: f"value-{i}-of-{k}" for k in keys},
                      [{"step": s, "tokens": 256 * s, "loss": 5.0 - 0.1 * s} for s in range(1, 5)])
            for i in range(3)]
    label = run_label(runs[0], keys)
    assert label.count("=") == 3 and label.endswith(", +8 more")
    figures = []
    monkeypatch.setattr(compare_runs, "save_figure", lambda fig, path: figures.append(fig))
    compare_runs.plot(runs, keys, tmp_path / "c.png", "3 runs")
    fig = figures[0]
    fig.canvas.draw()
    (legend,) = fig.legends
    assert legend.get_window_extent().width <= fig.bbox.width


def test_a_gpu_run_s_memory_peak_is_a_column(tmp_path):
    """CUDA runs log the allocator's peak in each row: the table shows the largest; CPU runs add no column."""
    from training.run.records import RunRecord, comparison

    gpu = RunRecord(tmp_path / "gpu", {"attention.name": "flash"},
                    [{"step": s, "tokens": 10 * s, "loss": 2.0, "tokens_per_s": 100.0, "peak_memory_bytes": p}
                     for s, p in ((1, 2**30), (2, 3 * 2**30))])
    cpu = RunRecord(tmp_path / "cpu", {"attention.name": "naive"},
                    [{"step": 1, "tokens": 10, "loss": 2.0, "tokens_per_s": 10.0}])
    headers, rows = comparison([gpu, cpu])
    assert headers[-1] == "peak memory" and [r[-1] for r in rows] == ["3.0 GiB", "-"]
    assert "peak memory" not in comparison([cpu])[0]
