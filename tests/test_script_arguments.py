"""Bad arguments to the tools in scripts/: one line on stderr, exit status 2, before any result
file is written or overwritten (they used to exit 0 with a nonsense table)."""
from __future__ import annotations

import sys

import pytest

from tests.trainrun import REPO, TOOLS as TOOL_FILES, run_in_process, run_script, tiny_overrides

sys.path.insert(0, str(REPO / "scripts"))

import data_stats  # noqa: E402
import eval_loss_by_position  # noqa: E402
import eval_passkey  # noqa: E402
import eval_passkey_documents  # noqa: E402
import max_context  # noqa: E402
from _common import run_cli  # noqa: E402

SENTINEL = "an earlier result\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    assert run_in_process(tiny_overrides(root / "tiny", root / "cache", steps=2)) == 0
    return root / "tiny"


@pytest.mark.parametrize("override,message", [
    ("start=0", "start=0: must be null or a positive integer"),
    ("granularity=1000", "start=64 is not a multiple of granularity=1000"),   # the CPU's default start
    ("memory_budget_mb=-5", "memory_budget_mb=-5.0: must be null or a number > 0"),
])
def test_max_context_refuses_bad_search_settings(tmp_path, monkeypatch, capsys, override, message):
    for suffix in (".json", ".md"):
        (tmp_path / f"mc{suffix}").write_text(SENTINEL)
    budget = [] if override.startswith("memory_budget_mb=") else ["memory_budget_mb=8"]
    line = run_script(max_context, ["model.vocab_size=256", "--attention", "naive", *budget, "device=cpu",
                                    "--out", str(tmp_path), "--name", "mc", override], monkeypatch, capsys)
    assert message in line, line
    assert all((tmp_path / f"mc{s}").read_text() == SENTINEL for s in (".json", ".md"))


@pytest.mark.parametrize("args,message", [
    (["--lengths", "0"], "--lengths 0: must be a positive integer"),
    (["--lengths", "-5"], "--lengths -5: must be a positive integer"),
    (["--lengths", "10"], "--lengths 10: a passkey prompt with a 5-digit key needs at least"),
    (["--key-digits", "0"], "--key-digits 0: must be a positive integer"),
    (["--trials", "0"], "--trials 0: must be a positive integer"),
    ([], "the run's trainer.seq_len=64 is shorter than the shortest passkey prompt"),
], ids=["length-0", "length-negative", "length-10", "key-digits-0", "trials-0", "default-lengths-empty"])
def test_eval_passkey_refuses_bad_arguments(trained, tmp_path, monkeypatch, capsys, args, message):
    out = tmp_path / "passkey_t.json"
    out.write_text(SENTINEL)
    line = run_script(eval_passkey, [str(trained), "--device", "cpu", "--out", str(tmp_path), "--name", "t",
                                     *args], monkeypatch, capsys)
    assert message in line, line
    assert out.read_text() == SENTINEL


@pytest.mark.parametrize("args,message", [
    (["--lengths", "64", "--docs", "0"], "error: --docs 0: must be a positive integer"),
    (["--lengths", "64"], "trained on data=stdlib without dense passkey documents"),
], ids=["docs-0", "no-passkey-documents"])
def test_eval_passkey_documents_refuses_a_run_without_its_questions(trained, tmp_path, monkeypatch, capsys, args,
                                                                     message):
    line = run_script(eval_passkey_documents, [str(trained), "--device", "cpu", "--out", str(tmp_path), "--name", "t",
                                               *args], monkeypatch, capsys)
    assert message in line, line
    assert not list(tmp_path.glob("passkey_documents_*"))


@pytest.mark.parametrize("flag", ["--batches", "--buckets", "--batch-size", "--seq-len"])
def test_eval_loss_by_position_refuses_zero_counts(trained, tmp_path, monkeypatch, capsys, flag):
    out = tmp_path / "loss_by_position_t.json"
    out.write_text(SENTINEL)
    line = run_script(eval_loss_by_position, [str(trained), "--device", "cpu", "--out", str(tmp_path),
                                              "--name", "t", flag, "0"], monkeypatch, capsys)
    assert line == f"error: {flag} 0: must be a positive integer"
    assert out.read_text() == SENTINEL


def test_data_stats_json_into_a_folder_is_one_line_and_leaves_no_tmp(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "stats"
    folder.mkdir()
    line = run_script(data_stats, [f"data.cache_dir={tmp_path / 'cache'}", "data.max_bytes=200000",
                                   "--json", str(folder)], monkeypatch, capsys)
    assert line == f"error: --json {folder} is a folder: pass a file path"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats"] and not list(folder.iterdir())


TOOLS = sorted(TOOL_FILES)


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_answers_a_bad_option_in_one_line_and_help_with_usage(tool, monkeypatch, capsys):
    """One argparse style for all: a bad option is one `error:` line and exit status 2 (no usage
    text); --help prints the usage and the tool's examples and exits 0."""
    import importlib

    module = importlib.import_module(tool)
    line = run_script(module, ["--no-such-option"], monkeypatch, capsys)
    assert "--no-such-option" in line or "required" in line, line
    monkeypatch.setattr(sys, "argv", [module.__file__, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(module.main)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")
    assert "argparse.ArgumentParser(" not in TOOL_FILES[tool].read_text()


def test_a_missing_input_file_names_its_flag(trained, monkeypatch, capsys):
    import generate

    line = run_script(generate, [str(trained), "--prompt-file", "missing.txt"], monkeypatch, capsys)
    assert line == "error: argument --prompt-file: no such file: missing.txt (--help lists the options)"
    line = run_script(generate, ["no/such/run", "--prompt", "x"], monkeypatch, capsys)
    assert line == "error: argument checkpoint: no such file or folder: no/such/run (--help lists the options)"
    line = run_script(generate, [str(trained), "--prompt", "x", "--temperature", "inf"], monkeypatch, capsys)
    assert line == "error: temperature=inf must be a finite number >= 0 (0: greedy)"


def test_output_paths_are_checked_before_any_work(trained, tmp_path, monkeypatch, capsys):
    import eval_loss_by_position
    import export_hf
    import export_weights
    import generate

    a_file = tmp_path / "file.txt"
    a_file.write_text(SENTINEL)
    assert run_script(generate, [str(trained), "--prompt", "x", "--jsonl", str(tmp_path)], monkeypatch,
                      capsys) == f"error: --jsonl {tmp_path} is a folder: pass a file path"
    assert run_script(export_hf, [str(trained), str(a_file)], monkeypatch,
                      capsys) == f"error: out_dir {a_file} is a file, not a folder"
    assert run_script(export_weights, [str(trained), str(tmp_path)], monkeypatch,
                      capsys) == f"error: out {tmp_path} is a folder: pass a file path"
    assert run_script(eval_loss_by_position, [str(trained), "--device", "cpu", "--out", str(a_file / "x")],
                      monkeypatch, capsys) == f"error: argument --out: {a_file / 'x'}: {a_file} is a file, not a folder (--help lists the options)"
    assert a_file.read_text() == SENTINEL


def test_export_weights_never_replaces_the_runs_own_file_by_default(trained, monkeypatch, capsys):
    import export_weights

    own = (trained / "model.safetensors").read_bytes()
    monkeypatch.setattr(sys, "argv", ["export_weights.py", str(trained / "checkpoints" / "step_00000002.pt")])
    run_cli(export_weights.main)
    written = trained / "model_step_00000002.safetensors"
    assert written.is_file() and (trained / "model.safetensors").read_bytes() == own
    line = run_script(export_weights, [str(trained)], monkeypatch, capsys)   # the same default again
    assert line == f"error: {written} exists; name another output file, or pass --force to replace it"
    line = run_script(export_weights, [str(trained), str(trained / "model.safetensors")], monkeypatch, capsys)
    assert line == f"error: {trained / 'model.safetensors'} exists; pass --force to replace it"
    assert (trained / "model.safetensors").read_bytes() == own


def test_kernel_tools_parse_and_refuse_without_hydra():
    """The GPU machines may lack Hydra and OmegaConf: a kernel tool parses its options and refuses a
    bad one in one line without them (it once died importing omegaconf for the override check)."""
    import subprocess

    blocked = ("import sys, runpy; sys.modules.update(omegaconf=None, hydra=None); "
               "sys.argv = ['bench_attention_scores.py', '--smoke', '--cases', 'bogus']; "
               f"runpy.run_path({str(REPO / 'scripts' / 'bench' / 'bench_attention_scores.py')!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr.strip()) == (2, "error: --cases: bogus not among none, dropout, softcap, sinks, all")
