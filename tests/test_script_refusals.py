"""More bad input to the tools in scripts/: one `error:` line naming the flag and its value, exit
status 2, before any work (each of these used to end in a traceback, a codec's message that named
no file, or a silently changed value)."""
from __future__ import annotations

import io
import subprocess
import sys

import pytest

from tests.trainrun import REPO, run_in_process, run_script, subprocess_env, tiny_overrides

sys.path.insert(0, str(REPO / "scripts"))

import bench_generation  # noqa: E402
import bench_loader  # noqa: E402
import bench_train  # noqa: E402
import compare_runs  # noqa: E402
import data_stats  # noqa: E402
import eval_loss_by_position  # noqa: E402
import generate  # noqa: E402

BAD_TOKENIZER = ["tokenizer=bpe", "tokenizer.min_frequency=-1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step tiny run on a small corpus (its validation split is some 15K tokens)."""
    root = tmp_path_factory.mktemp("run")
    assert run_in_process(tiny_overrides(root / "tiny", root / "cache", steps=2, **{"data.max_bytes": 300_000})) == 0
    return root / "tiny"


@pytest.mark.parametrize("overrides,message", [
    (BAD_TOKENIZER, "error: tokenizer.min_frequency=-1: must be a positive integer"),
    (["tokenizer=bpe", "tokenizer.train_max_bytes=0"],
     "error: tokenizer.train_max_bytes=0: must be null or a positive integer"),
], ids=["min-frequency", "train-max-bytes"])
@pytest.mark.parametrize("tool", [data_stats, bench_loader], ids=["data_stats", "bench_loader"])
def test_data_tools_check_the_config_as_train_does(tool, overrides, message, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    out = ["--out", str(tmp_path / "out")] if tool is bench_loader else []
    line = run_script(tool, [f"data.cache_dir={cache}", "data.max_bytes=300000", *overrides, *out], monkeypatch, capsys)
    assert line == message
    assert not cache.exists() and not (tmp_path / "out").exists()   # no tokenizer trained, nothing written


def test_bench_train_checks_every_case_config_before_measuring(tmp_path, monkeypatch, capsys):
    line = run_script(bench_train, ["--smoke", "--attention", "sdpa", "--lengths", "64", "--tokens", "128",
                                    "--steps", "1", "--warmup", "1", "--out", str(tmp_path / "out"), *BAD_TOKENIZER],
                      monkeypatch, capsys)
    assert line == "error: tokenizer.min_frequency=-1: must be a positive integer"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--batches", "--seq-len", "--batch-size"])
def test_bench_loader_refuses_zero_counts(flag, tmp_path, monkeypatch, capsys):
    line = run_script(bench_loader, [f"data.cache_dir={tmp_path / 'cache'}", flag, "0",
                                     "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert line == f"error: {flag} 0: must be a positive integer"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_generate_names_a_prompt_file_that_is_not_utf8(tmp_path, monkeypatch, capsys):
    """Refused before the checkpoint is loaded (tmp_path only has to exist), from a file or stdin."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"\xfe\xffdef main(")
    line = run_script(generate, [str(tmp_path), "--prompt-file", str(prompt)], monkeypatch, capsys)
    assert line == f"error: --prompt-file {prompt}: not UTF-8 text (byte 0xfe at 0)"
    # stdin as a C locale opens it: undecodable bytes become surrogates, which failed only when encoded
    stdin = io.TextIOWrapper(io.BytesIO(b"ab\xc3"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)
    line = run_script(generate, [str(tmp_path), "--prompt-file", "-"], monkeypatch, capsys)
    assert line == "error: --prompt-file -: not UTF-8 text (byte 0xc3 at 2)"


@pytest.mark.parametrize("args,message", [
    (["--lengths", "abc"], "error: --lengths 'abc': expected comma-separated integers"),
    (["--lengths", ","], "error: --lengths ',': name at least one sequence length"),
    (["--lengths", "64,128", "--tokens", "10"], "error: --tokens 10: fewer than one sequence of 64 tokens (--lengths)"),
    (["--ablation", "--ablation-len", "256", "--tokens", "128"],
     "error: --tokens 128: fewer than one sequence of 256 tokens (--ablation-len)"),
], ids=["lengths-not-int", "lengths-empty", "tokens-below-length", "tokens-below-ablation-len"])
def test_bench_train_refuses_bad_lengths_and_tokens(args, message, tmp_path, monkeypatch, capsys):
    line = run_script(bench_train, ["--smoke", "--attention", "sdpa", "--out", str(tmp_path / "out"), *args],
                      monkeypatch, capsys)
    assert line.startswith(message), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("buckets", ["3", "16"])   # 16 is the default: argparse's own check missed it
def test_eval_loss_by_position_refuses_both_bucket_flags(buckets, tmp_path, monkeypatch, capsys):
    line = run_script(eval_loss_by_position, [str(tmp_path), "--buckets", buckets, "--bucket-tokens", "8"],
                      monkeypatch, capsys)
    assert line == "error: argument --bucket-tokens: not allowed with argument --buckets (--help lists the options)"


def test_eval_loss_by_position_names_its_own_flag_for_a_window_too_long(trained, tmp_path, monkeypatch, capsys):
    """The data builder's message said 'lower trainer.seq_len', which this tool has no way to set."""
    line = run_script(eval_loss_by_position, [str(trained), "--device", "cpu", "--seq-len", "40000",
                                              "--out", str(tmp_path)], monkeypatch, capsys)
    assert line.startswith("error: the validation split has ") and line.endswith("or lower --seq-len"), line


@pytest.mark.parametrize("name", ["", "a/b", ".."])
def test_compare_runs_refuses_a_name_that_is_not_a_file_name(trained, name, tmp_path, monkeypatch, capsys):
    """'' wrote out.json, .md and .png beside the --out folder, 'a/b' into a folder under it."""
    out = tmp_path / "out"
    line = run_script(compare_runs, [str(trained), "--out", str(out), "--name", name], monkeypatch, capsys)
    assert line == (f"error: argument --name: {name!r}: expected a file name without folders (the files go into "
                    f"--out) (--help lists the options)")
    assert list(tmp_path.iterdir()) == []


def test_bench_generation_checks_a_given_value_under_smoke(tmp_path, monkeypatch, capsys):
    """--smoke changes the defaults only: a value the user gave is kept, so a bad one is refused."""
    line = run_script(bench_generation, ["--smoke", "--device", "cpu", "--decode-steps", "-1",
                                         "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert line == "error: --decode-steps -1: must be a positive integer"
    assert not (tmp_path / "out").exists()
    line = run_script(bench_generation, ["--smoke", "--device", "cpu", "--warmup-steps", "-1",
                                         "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert line == "error: --warmup-steps -1: must be 0 or more"   # 0 warm-up steps is a choice, -1 is not


@pytest.mark.parametrize("script", ["eval_passkey.py", "eval_loss_by_position.py", "max_context.py",
                                    "bench/check_gpu_resume.py", "bench/compare_attention_losses.py",
                                    "bench/bench_parallel.py"])
def test_every_name_option_takes_a_file_name_only(script):
    """Every tool's --name is a file stem inside --out (`_common.file_stem`): '' and 'a/b' would write
    beside --out or into a folder under it (bench_parallel fell back to its default name)."""
    for name in ("", "a/b"):
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--name", name], cwd=REPO,
                              env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip() == (
            f"error: argument --name: {name!r}: expected a file name without folders (the files go into --out) "
            "(--help lists the options)"), proc.stderr
