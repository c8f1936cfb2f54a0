"""experiment=shakespeare-char on the CPU: a tiny text file through the same path the GPU run
takes (files source, bytes tokenizer, the last 10% held out, our kernel with attention dropout,
in Triton's interpreter, moving windows), then scripts/generate.py from the run's folder, and the
comparison script's own plumbing (run --smoke, report) on our side of it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.trainrun import REPO, cache_dir, run_in_process, subprocess_env  # noqa: F401 (a fixture)

# Small enough for a few CPU steps (our kernel runs in Triton's interpreter); everything else is the experiment's.
SMALL = ["model.n_layer=1", "model.d_model=64", "model.n_head=2", "model.n_kv_head=2", "trainer.batch_size=2",
         "trainer.seq_len=64", "model.max_seq_len=64", "trainer.max_steps=6", "trainer.eval_every=3",
         "trainer.eval_batches=2", "trainer.compile=false", "trainer.progress=false", "device=cpu"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    lines = [f"{who}:\nWhat say you to line {i}, good {who.lower()}?\n\n" for i in range(300)
             for who in ("ROMEO", "JULIET", "MERCUTIO")]
    path = tmp_path_factory.mktemp("text") / "input.txt"
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, text_file, cache_dir):
    run_dir = tmp_path_factory.mktemp("shakespeare-char")
    overrides = ["experiment=shakespeare-char", f"data.paths=[{text_file}]", f"run.dir={run_dir}",
                 f"data.cache_dir={cache_dir}", *SMALL]
    assert run_in_process(overrides) == 0
    return run_dir


def test_the_recipe_runs_on_a_local_text_file_with_nanogpts_split(run_dir, text_file):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert (cfg.attention.name, cfg.model.dropout, cfg.model.attention_dropout) == ("flash", 0.2, 0.2)
    assert (cfg.model.pos_emb, cfg.model.norm, cfg.model.mlp) == ("learned", "layernorm", "gelu")   # nanoGPT's
    assert (cfg.data.windows, cfg.optim.betas, cfg.optim.warmup_steps) == ("moving", [0.9, 0.99], 100)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    from training.builders import build_data

    bundle = build_data(cfg, seq_len=64, seed=cfg.seed, progress=False)
    n_chars = len(text_file.read_text())
    held_out = n_chars - int(n_chars * 0.9)   # nanoGPT's prepare.py: the text after its first 90%
    # the last 10% of the tokens: those characters (to rounding; exactly on tiny-shakespeare) and the EOT
    assert bundle.val_split == "tokens" and abs(bundle.val_tokens - 1 - held_out) <= 1


def test_generate_from_the_run_folder(run_dir):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(run_dir), "--prompt", "ROMEO:",
                             "--max-new-tokens", "20", "--device", "cpu"],
                            cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ROMEO:" in result.stdout


@pytest.mark.slow
def test_comparison_script_runs_and_reports_our_side(tmp_path, text_file):
    script = REPO / "scripts" / "bench" / "bench_shakespeare_char.py"
    run = subprocess.run([sys.executable, str(script), "run", "--smoke", "--steps", "20", "--runs", "ours-nanogpt-arch",
                          "--text", str(text_file), "--nanogpt", str(tmp_path), "--work", str(tmp_path / "work"),
                          "--out", str(tmp_path / "out")],
                         cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = subprocess.run([sys.executable, str(script), "report", "--pack",
                             str(tmp_path / "out" / "shakespeare_char_runs.tar.gz"), "--out", str(tmp_path / "report")],
                            cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    result = json.loads((tmp_path / "report" / "shakespeare_char_cpu_smoke.json").read_text())
    (ours,) = result["runs"]
    assert ours["name"] == "ours-nanogpt-arch" and ours["exit"] == 0 and ours["best_step"] in (10, 20)
    assert [s for s, _ in ours["val_curve"]] == [10, 20] and ours["train_loss_at_end_eval_mode"] > 0
    assert (tmp_path / "report" / "shakespeare_char_cpu_smoke.png").is_file()
