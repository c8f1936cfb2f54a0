"""experiment=long-context-passkey and its naive and CPU variants: the presets agree with each other
and with the committed measurements they are sized from, and the CPU variant runs the whole
sequence (train, passkey grid with a length that does not fit, loss by position with a second
curve beside it) in well under a minute on 2 cores."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from tests.trainrun import REPO, cache_dir, run_in_process  # noqa: F401 (cache_dir is a fixture)

sys.path.insert(0, str(REPO / "scripts"))
RUNS_SCRIPT = REPO / "benchmarks" / "long_context_runs.sh"   # the GPU runs, which the script tests read off

import eval_loss_by_position  # noqa: E402
import eval_passkey  # noqa: E402
import eval_passkey_documents  # noqa: E402


def composed(experiment: str):
    from training.config import compose
    from training.config.checks import validate_config

    cfg = compose([f"experiment={experiment}"])
    validate_config(cfg)
    return cfg


def tokens(cfg) -> int:
    t = cfg.trainer
    return t.max_steps * t.batch_size * t.grad_accum * t.seq_len


def test_naive_runs_the_flash_recipe_at_its_longest_trainable_context_for_as_many_tokens():
    flash, naive = composed("long-context-passkey"), composed("long-context-passkey-naive")
    assert (flash.attention.name, naive.attention.name) == ("flash", "naive")
    assert flash.trainer.seq_len == flash.data.passkey.length == 32768
    committed = json.loads((REPO / "benchmarks" / "max_context" / "max_context_h200.json").read_text())
    longest = {(r["impl"], r["features"]): r["max_length"] for r in committed["results"]}
    # the recipe's memory features: chunked cross-entropy, no activation checkpointing ("plain" for naive)
    assert flash.model.activation_checkpointing == "none" and flash.model.loss_chunk_size > 0
    assert naive.trainer.seq_len == naive.data.passkey.length == longest[("naive", "plain")]
    assert tokens(naive) == tokens(flash)
    passkey = lambda cfg: cfg.data.passkey.num_docs * cfg.data.passkey.length   # noqa: E731
    assert abs(passkey(naive) / passkey(flash) - 1) < 0.01
    for key in ("model", "optim", "tokenizer"):   # the same model, optimizer and vocabulary
        assert naive[key] == flash[key], key
    same_data = ("min_doc_bytes", "max_bytes", "include_tests", "val_fraction", "passkey.key_digits",
                 "passkey.seed", "passkey.depths")
    assert all(OmegaConf.select(naive.data, k) == OmegaConf.select(flash.data, k) for k in same_data)


@pytest.mark.slow
def test_the_cpu_variant_trains_evaluates_and_writes_the_grid(tmp_path, cache_dir):  # noqa: F811
    run = tmp_path / "run"
    assert run_in_process(["experiment=long-context-passkey-cpu", f"run.dir={run}", f"data.cache_dir={cache_dir}",
                           "trainer.progress=false"]) == 0
    out = tmp_path / "eval"
    # naive under a CPU budget that holds a 512-token forward but not a 1,024-token one
    eval_passkey.main([str(run), "--lengths", "128", "256", "512", "1024", "--depths", "0", "0.5", "1",
                       "--trials", "2", "--attention", "naive", "--memory-budget-mb", "20", "--out", str(out),
                       "--name", "naive"])
    naive = json.loads((out / "passkey_naive.json").read_text())
    assert naive["why_not"][:3] == [None] * 3 and naive["why_not"][3].startswith("out of memory")
    assert all(row[3] is None and all(0 <= a <= 1 for a in row[:3]) for row in naive["accuracy"])
    assert all(p > 0 for p in naive["peak_memory_bytes"][:3]) and naive["trained_seq_len"] == 512
    eval_passkey.main([str(run), "--lengths", "128", "256", "512", "--depths", "0", "0.5", "1", "--trials", "2",
                       "--out", str(out), "--name", "sdpa", "--beside", str(out / "passkey_naive.json")])
    md = (out / "passkey_sdpa.md").read_text()
    assert "## Beside it: naive" in md and md.count("| does not fit") == 3 and "1,024*" in md
    assert (out / "passkey_sdpa.png").stat().st_size > 10_000
    eval_loss_by_position.main([str(run), "--seq-len", "256", "--bucket-tokens", "128", "--batches", "2",
                                "--out", str(out), "--name", "short"])
    eval_loss_by_position.main([str(run), "--bucket-tokens", "128", "--batches", "2", "--out", str(out),
                                "--name", "long", "--beside", str(out / "loss_by_position_short.json")])
    long = json.loads((out / "loss_by_position_long.json").read_text())
    assert [(b["start"], b["end"]) for b in long["buckets"]] == [(0, 128), (128, 256), (256, 384), (384, 512)]
    assert long["validation"] == long["beside"]["validation"]
    rows = [line for line in (out / "loss_by_position_long.md").read_text().splitlines() if line.startswith("| [")]
    assert len(rows) == 4 and rows[-1].endswith("| - |") and (out / "loss_by_position_long.png").exists()


def test_the_gpu_script_refuses_to_continue_a_run_its_machine_does_not_hold(tmp_path):
    """benchmarks/long_context_runs.sh: `continue` on a fresh machine (the run went with the last one)
    says so instead of training from step 0 again; a bad part is the usage line; nothing is run."""
    import os
    import subprocess

    assert subprocess.run(["bash", "-n", str(RUNS_SCRIPT)]).returncode == 0
    env = dict(os.environ, OUT=str(tmp_path))
    if (REPO / "runs" / "long-context" / "naive").exists():
        pytest.skip("a naive run of the GPU script is in this checkout")
    done = run_script(REPO, env, "naive", "continue", check=False, timeout=60)
    assert done.returncode == 2 and "error: no run in runs/long-context/naive" in done.stdout
    env["EVALS"] = str(tmp_path / "evals")   # session 1's results not committed: naive does not start
    first = run_script(REPO, env, "naive", check=False, timeout=60)
    assert first.returncode == 2 and "long_context_passkey_flash/config.yaml is not committed" in first.stdout
    bad = run_script(REPO, env, "nope", check=False, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("usage: ")


def dense_stages() -> list[list[str]]:
    """The overrides of each stage of benchmarks/long_context_runs.sh's `dense`, as the script has them."""
    text = RUNS_SCRIPT.read_text()
    block = re.search(r"DENSE_STAGES=\((.*?)\n\)", text, re.S).group(1)
    return [stage.split() for stage in re.findall(r'"([^"]*)"', block)]


@pytest.mark.parametrize("experiment,stages", [
    ("long-context-dense", dense_stages()),
    # the CPU curriculum's stages, as configs/experiment/long-context-dense-cpu.yaml documents them
    ("long-context-dense-cpu", [["data.passkey.kind=single", "data.passkey.pairs=null", "data.passkey.length=32",
                                 "data.passkey.num_docs=40000", "trainer.max_steps=1500"],
                                ["data.passkey.length=256", "data.passkey.pairs=1", "data.passkey.num_docs=8000",
                                 "trainer.max_steps=3300"], []]),
])
def test_the_dense_curriculum_stages_fill_whole_windows_up_to_the_last(experiment, stages):
    """A first stage of bare key sentences and questions may come first (where the copy forms);
    then each stage's dense documents tile its windows exactly (a whole number of documents a window,
    and of windows in all), so under data.windows=fixed no document straddles two windows; the
    documents grow, the steps only go up, and the last stage's documents are as long as the window."""
    steps, lengths = [], []
    for i, overrides in enumerate(stages):
        cfg = composed_with(experiment, overrides)
        p, seq_len = cfg.data.passkey, cfg.trainer.seq_len
        steps.append(cfg.trainer.max_steps)
        assert cfg.data.windows == "fixed"
        if p.kind == "single":
            assert i == 0 and p.length <= 64   # filler-free passkey documents, the first stage only
            continue
        assert p.kind == "dense" and p.pairs >= 1
        assert seq_len % p.length == 0 and (p.num_docs * p.length) % seq_len == 0
        lengths.append(p.length)
    assert steps == sorted(steps) and lengths == sorted(lengths) and len(set(lengths)) == len(lengths)
    assert lengths[-1] == seq_len and stages[-1] == []   # the last stage is the preset as it is
    if experiment == "long-context-dense":
        assert seq_len == 32768 and cfg.attention.name == "flash"


def composed_with(experiment: str, overrides: list[str]):
    from training.config import compose
    from training.config.checks import validate_config

    cfg = compose([f"experiment={experiment}", *overrides])
    validate_config(cfg)
    return cfg


def script_overrides(array: str) -> list[str]:
    """The overrides benchmarks/long_context_runs.sh keeps in bash array `array` (MIXED_LONG, ...), as
    bash expands them (an array may be built from another): its MIXED_* definitions, run by bash."""
    import subprocess

    text = RUNS_SCRIPT.read_text()
    definitions = "\n".join(re.findall(r"^MIXED_\w+=\(.*?\)(?=\s*(?:#[^\n]*)?\n)", text, re.S | re.M))
    shown = subprocess.run(["bash", "-c", f'{definitions}\nprintf "%s\\n" "${{{array}[@]}}"'],
                           capture_output=True, text=True, check=True).stdout
    return shown.splitlines()


def test_the_mixed_recipe_cuts_whole_windows_into_documents_read_on_their_own():
    """experiment=long-context-mixed and its second stage (the script's `mixed-long`): each unit is
    one window, cut into documents that tile it exactly; the document mask keeps them apart; the
    second stage continues the first (more steps, the same window) on units weighted to long
    documents."""
    first = composed_with("long-context-mixed", [])
    second = composed_with("long-context-mixed", script_overrides("MIXED_LONG"))
    for cfg in (first, second):
        p = cfg.data.passkey
        assert cfg.attention.name == "flash" and cfg.trainer.seq_len == p.length == 32768
        assert cfg.data.windows == "fixed" and cfg.data.document_mask and p.kind == "dense" and p.pairs == 1
        assert all(p.length % n == 0 for n in p.pieces) and min(p.pieces) == 1
    assert second.trainer.max_steps > first.trainer.max_steps and second.data.allow_changed
    share = lambda pieces: sum(n <= 4 for n in pieces) / len(pieces)   # noqa: E731  units of >= 8K-token documents
    assert share(second.data.passkey.pieces) > 2 * share(first.data.passkey.pieces)
    # the scaled variant: the same two stages with model.attention_length_scale, nothing else changed
    scaled = composed_with("long-context-mixed", script_overrides("MIXED_SCALED") + script_overrides("MIXED_LONG"))
    assert scaled.model.attention_length_scale >= 2
    scaled.model.attention_length_scale = None
    assert scaled == second
    # the base variant: the scaled one with a RoPE base at which some rotation pairs turn less than a
    # quarter over the window (10,000 leaves none), nothing else changed
    based = composed_with("long-context-mixed", script_overrides("MIXED_SCALED") + script_overrides("MIXED_BASE")
                          + script_overrides("MIXED_LONG"))
    dim = based.model.d_model // based.model.n_head
    slow = [i for i in range(dim // 2) if 2 * math.pi * based.model.rope_theta ** (2 * i / dim) > 4 * based.trainer.seq_len]
    assert len(slow) >= 4 and second.model.rope_theta ** ((dim - 2) / dim) * 2 * math.pi < 4 * second.trainer.seq_len
    # the README's recipe as first run (experiment=long-context-retrieval-32k and -long, the script's
    # mixed-digits and mixed-digits-whole): the base one with a BPE that keeps every digit its own
    # token and MIXED_WHOLE's second stage, nothing else but the runs' names (and stage 2's resume=continue: it never trains
    # without stage 1's checkpoint)
    base_first = composed_with("long-context-mixed", script_overrides("MIXED_SCALED") + script_overrides("MIXED_BASE"))
    base_whole = composed_with("long-context-mixed", script_overrides("MIXED_SCALED") + script_overrides("MIXED_BASE")
                               + script_overrides("MIXED_WHOLE"))
    for recipe, base, resume in ((composed("long-context-retrieval-32k"), base_first, None),
                                 (composed("long-context-retrieval-long"), base_whole, "continue")):
        assert recipe.tokenizer.name == "bpe" and recipe.tokenizer.split_digits and not base.tokenizer.split_digits
        assert recipe.resume == resume
        recipe.tokenizer.split_digits, recipe.run.name, recipe.resume = False, base.run.name, base.resume
        assert recipe == base
    based.model.rope_theta, based.model.attention_length_scale = second.model.rope_theta, None
    assert based == second
    # the longer second stage: MIXED_LONG's overrides with more steps, nothing else changed
    longer, long = script_overrides("MIXED_LONGER"), script_overrides("MIXED_LONG")
    assert len(longer) == len(long) and [o for o in longer if not o.startswith("trainer.max_steps=")] == \
        [o for o in long if not o.startswith("trainer.max_steps=")]
    assert composed_with("long-context-mixed", longer).trainer.max_steps > second.trainer.max_steps
    # the far variant: MIXED_LONG's second stage with several keys in each long document only
    far = script_overrides("MIXED_FAR")
    assert [o for o in far if not o.startswith("data.passkey.piece_pairs=")] == long
    farther = composed_with("long-context-mixed", far).data.passkey
    keys = dict(zip(farther.pieces, farther.piece_pairs))
    assert len(farther.piece_pairs) == len(farther.pieces) and keys[1] > keys[4] > keys[16] == keys[512] == 1
    # the whole variant: MIXED_LONG's second stage with more of its units left as one 32K document
    whole = script_overrides("MIXED_WHOLE")
    assert [o for o in whole if not o.startswith("data.passkey.pieces=")] == \
        [o for o in long if not o.startswith("data.passkey.pieces=")] and len(whole) == len(long)
    more = composed_with("long-context-mixed", whole).data.passkey
    before = second.data.passkey.pieces
    assert set(more.pieces) == set(before) and more.piece_pairs is None
    assert more.num_docs == second.data.passkey.num_docs
    assert more.pieces.count(1) / len(more.pieces) > 1.5 * before.count(1) / len(before)


def test_the_readme_recipe_is_the_run_it_cites():
    """The README's two presets compose to the committed configs of the runs their numbers come from:
    experiment=long-context-retrieval (stage 1, 8K windows) to mixed-digits-8k's (and from seed 2,026
    to mixed-digits-8k-seed2026's), and long-context-retrieval-long (stage 2) to mixed-digits-warm8k's,
    branched from it (and to mixed-digits-whole's, which continued the 32K stage 1; with MIXED_LONG's
    units, the script's mixed-digits-long, to mixed-digits'): every setting but those a run fills in
    or a call sets."""
    from training.run.records import flatten

    def differences(cfg, committed: str) -> dict:
        cfg.run.dir = "x"
        ours = flatten(OmegaConf.to_container(cfg, resolve=True))
        measured = OmegaConf.load(REPO / "benchmarks" / "evals" / committed / "config.yaml")
        theirs = flatten(OmegaConf.to_container(measured))
        filled = {"device", "resume", "attention.plan", "trainer.progress", "trainer.precision", "run.dir",
                  "run.name", "run.world_size", "run.data_fingerprint", "run.num_params",
                  "data.cache_dir"}   # the machine's (FLASHTRAIN_CACHE)
        added = {"data.passkey.ask_last": False, "model.rope_fraction": 1.0}   # settings newer than the run, at the value it ran with
        filled |= {key for key, value in added.items() if key not in theirs and ours.get(key) == value}
        return {key: (ours.get(key), theirs.get(key)) for key in ours.keys() | theirs.keys()
                if key not in filled and ours.get(key) != theirs.get(key)}

    assert differences(composed("long-context-retrieval"), "long_context_passkey_mixed-digits-8k") == {}
    assert differences(composed_with("long-context-retrieval", ["seed=2026"]),
                       "long_context_passkey_mixed-digits-8k-seed2026") == {}
    for run in ("mixed-digits-warm8k", "mixed-digits-whole"):
        assert differences(composed("long-context-retrieval-long"), f"long_context_passkey_{run}") == {}, run
    assert differences(composed_with("long-context-retrieval-long", ["seed=2026"]),
                       "long_context_passkey_mixed-digits-warm8k-seed2026") == {}
    assert differences(composed_with("long-context-retrieval-long", script_overrides("MIXED_LONG")),
                       "long_context_passkey_mixed-digits") == {}
    # and the differences would show: the older units are not the recipe's
    assert "data.passkey.pieces" in differences(composed("long-context-retrieval-long"),
                                                "long_context_passkey_mixed-digits")


@pytest.mark.parametrize("preset, second, measured, fewer", [
    ("long-context-mixed-naive", "MIXED_NAIVE_LONG", "max_context_h200.json", 1),
    ("long-context-mixed-naive-h100", "MIXED_NAIVE_H100_LONG", "max_context_h100_naive.json", 2),
])
def test_the_mixed_recipe_with_naive_attention_trains_as_many_tokens_at_its_longest_context(preset, second, measured,
                                                                                           fewer):
    """experiment=long-context-mixed-naive (H200) and -naive-h100, each with its second stage (the
    script's `mixed-naive-long`, NAIVE_ON=h200 or h100), are the README's recipe's two stages with
    naive attention, in windows of naive's longest trainable length on that GPU: the same model,
    optimizer and vocabulary, units cut as flash's are into documents of one key (down to 64 tokens,
    `fewer` lengths fewer to halve through in stage 1), as many passkey tokens and as many tokens in all."""
    flash = [composed("long-context-retrieval-32k"), composed("long-context-retrieval-long")]
    naive = [composed(preset), composed_with(preset, script_overrides(second))]
    committed = json.loads((REPO / "benchmarks" / "max_context" / measured).read_text())
    longest = {(r["impl"], r["features"]): r["max_length"] for r in committed["results"]}
    for f, n in zip(flash, naive):
        p, q = f.data.passkey, n.data.passkey
        assert (f.attention.name, n.attention.name) == ("flash", "naive")
        assert n.trainer.seq_len == q.length == longest[("naive", "plain")]
        assert abs(tokens(n) / tokens(f) - 1) < 0.001
        assert abs(q.num_docs * q.length / (p.num_docs * p.length) - 1) < 0.005
        assert all(q.length % k == 0 for k in q.pieces) and q.length // max(q.pieces) == p.length // max(p.pieces)
        assert len(q.pieces) == len(p.pieces) - fewer * (f is flash[0])
        assert q.pieces.count(max(q.pieces)) == p.pieces.count(max(p.pieces)) and q.pieces.count(1) == p.pieces.count(1)
        assert (n.data.windows, n.data.document_mask, q.kind, q.pairs) == (f.data.windows, f.data.document_mask,
                                                                            p.kind, p.pairs)
        for key in ("model", "optim", "tokenizer"):
            assert n[key] == f[key], key
    assert naive[1].trainer.max_steps > naive[0].trainer.max_steps and naive[1].data.allow_changed


def script_env(tmp_path, calls: Path, **extra: str) -> dict[str, str]:
    """The environment to run the GPU script in without a GPU: first on PATH a `python3` that only
    appends its command line to `calls` ($CALLS), so the test reads what the script would have run;
    $OUT under tmp_path; `extra` on top."""
    fake = tmp_path / "bin"
    if not fake.exists():
        fake.mkdir()
        (fake / "python3").write_text("#!/bin/sh\necho \"python3 $*\" >> \"$CALLS\"\n")
        (fake / "python3").chmod(0o755)
    return {"PATH": f"{fake}:/usr/bin:/bin", "CALLS": str(calls), "OUT": str(tmp_path / "out"), **extra}


def run_script(cwd: Path, env: dict[str, str], *args: str, check: bool = True, timeout: float | None = None):
    """benchmarks/long_context_runs.sh ARGS from `cwd` under `env` (script_env's, or the real one),
    output captured."""
    import subprocess

    return subprocess.run(["bash", str(RUNS_SCRIPT), *args], cwd=cwd, env=env, check=check,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("gpu, run, preset, second_steps", [
    ("h200", "mixed-naive", "long-context-mixed-naive", "2812"),
    ("h100", "mixed-naive-h100", "long-context-mixed-naive-h100", "2900"),
])
def test_the_naive_share_of_the_mixed_recipe_sets_both_stages_steps(tmp_path, gpu, run, preset, second_steps):
    """NAIVE_STEPS=N,M (one machine's share of the ~80-minute naive run): stage 1 to N steps, stage
    2 to M; without it, the preset's and its second stage's (MIXED_NAIVE_LONG, or with NAIVE_ON=h100
    MIXED_NAIVE_H100_LONG), in that GPU's run. Read off what the script would run."""
    runs = tmp_path / "runs" / "long-context" / run
    runs.mkdir(parents=True)
    (runs / "config.yaml").write_text("{}")
    (runs / "metrics.jsonl").write_text("")
    for steps, want in ((None, [second_steps]), ("300,500", ["500"])):
        calls = tmp_path / f"calls-{steps}"
        env = script_env(tmp_path, calls, NAIVE_ON=gpu, **({"NAIVE_STEPS": steps} if steps else {}))
        run_script(tmp_path, env, "mixed-naive-long")
        assert re.findall(r"trainer\.max_steps=(\d+)", calls.read_text()) == want
        run_script(tmp_path, env, "mixed-naive", "continue")
        assert re.findall(r"trainer\.max_steps=(\d+)", calls.read_text())[1:] == ([] if steps is None else ["300"])
        assert all(f"experiment={preset} run.dir=runs/long-context/{run} " in call
                   for call in calls.read_text().splitlines())
    env["NAIVE_ON"] = "a100"
    refused = run_script(tmp_path, env, "mixed-naive-long", check=False)
    assert refused.returncode == 2 and "NAIVE_ON=a100: expected h200 or h100" in refused.stderr


def test_the_flash_share_runs_the_readme_recipe_to_its_steps_and_naive_is_drawn_beside_it(tmp_path):
    """recipe-share: the README's two presets as one run cut to SHARE_STEPS=N,M (refused without
    it), and NAIVE_BESIDE=recipe-share draws the naive share's grid and loss curve beside that run
    instead of the whole recipe's. Read off what the script would run."""
    run = tmp_path / "runs" / "long-context" / "recipe-share"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    calls = tmp_path / "calls"
    env = script_env(tmp_path, calls)
    for case in ("recipe-share", "recipe-share-long"):
        refused = run_script(tmp_path, env, case, check=False)
        assert refused.returncode == 2 and f"{case} needs SHARE_STEPS=N,M" in refused.stdout
    assert not calls.exists()
    env["SHARE_STEPS"] = "300,500"
    for case in ("recipe-share", "recipe-share-long"):
        run_script(tmp_path, env, case)
    first, second = calls.read_text().splitlines()
    assert "experiment=long-context-retrieval-32k run.dir=runs/long-context/recipe-share " in first
    assert re.findall(r"trainer\.max_steps=(\d+)", first) == ["300"]
    assert "experiment=long-context-retrieval-long run.dir=runs/long-context/recipe-share " in second
    assert re.findall(r"trainer\.max_steps=(\d+)", second) == ["500"]
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "loss_by_position_long_context_passkey_recipe-share.json").write_text("{}")
    for beside in ("recipe-share", None):
        calls.unlink()
        run_script(tmp_path, {**env, "EVALS": str(evals), **({"NAIVE_BESIDE": beside} if beside else {})},
                   "mixed-naive-eval")
        drawn = re.findall(r"--beside \S+_long_context_passkey_(\S+)\.json", calls.read_text())
        assert drawn == (["recipe-share", "recipe-share"] if beside else ["mixed-digits-whole"])


def test_naive_s_share_with_our_kernel_is_naive_s_run_but_for_the_attention(tmp_path):
    """mixed-naive-flash[-long|-eval]: naive's preset and stages to NAIVE_STEPS with attention=flash,
    in a run of its own beside naive's, evaluated with flash beside naive's results; `compare` with
    NAIVE_ON=h100 tabulates the three H100 shares. Read off what the script would run."""
    for run in ("mixed-naive-h100", "mixed-naive-h100-flash"):
        (tmp_path / "runs" / "long-context" / run).mkdir(parents=True)
        (tmp_path / "runs" / "long-context" / run / "config.yaml").write_text("{}")
        (tmp_path / "runs" / "long-context" / run / "metrics.jsonl").write_text("")
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "loss_by_position_long_context_passkey_mixed-naive-h100.json").write_text("{}")
    calls = {}
    for attention, cases in (("naive", ("mixed-naive", "mixed-naive-long", "mixed-naive-eval")),
                             ("flash", ("mixed-naive-flash", "mixed-naive-flash-long", "mixed-naive-flash-eval"))):
        calls[attention] = tmp_path / f"calls-{attention}"
        env = script_env(tmp_path, calls[attention], NAIVE_ON="h100", NAIVE_STEPS="300,500", EVALS=str(evals))
        run_script(tmp_path, env, cases[0], "continue")   # (naive's first call checks its BPE first)
        for case in cases[1:]:
            run_script(tmp_path, env, case)
    naive, flash = (calls[a].read_text().splitlines() for a in ("naive", "flash"))
    for a, b in zip(naive[:2], flash[:2]):   # the two stages: the same command but for run and attention
        assert b.replace("mixed-naive-h100-flash", "mixed-naive-h100").replace(" attention=flash", "") == a
        assert "experiment=long-context-mixed-naive-h100 run.dir=runs/long-context/mixed-naive-h100-flash " in b
        assert " attention=flash" in b
    assert re.findall(r"trainer\.max_steps=(\d+)", "\n".join(flash[:2])) == ["300", "500"]
    assert "--attention flash" in flash[2] and "runs/long-context/mixed-naive-h100-flash" in flash[2]
    assert re.findall(r"--beside \S+_long_context_passkey_(\S+)\.json", "\n".join(flash[2:])) == \
        ["mixed-naive-h100", "mixed-naive-h100"]
    compare = tmp_path / "calls-compare"
    run_script(tmp_path, script_env(tmp_path, compare, NAIVE_ON="h100", EVALS=str(evals)), "compare")
    assert re.findall(r"long_context_passkey_(\S+)", compare.read_text()) == \
        ["recipe-share", "mixed-naive-h100", "mixed-naive-h100-flash", "h100"]


def test_a_second_stage_waits_for_the_first_to_finish(tmp_path):
    """mixed-naive-long, whose first stage spans calls: refused while stage 1 stopped short of its
    max_steps (a call's deadline), run once stage 1 is done, and run again to go on with stage 2
    once stage 2 has started. Read off what the script would run."""
    run = tmp_path / "runs" / "long-context" / "mixed-naive"
    run.mkdir(parents=True)
    env = script_env(tmp_path, tmp_path / "calls", NAIVE_STEPS="330,562")
    for planned, last, runs in ((330, 300, False), (330, 330, True), (562, 400, True)):
        (run / "config.yaml").write_text(f"model:\n  max_steps: 1\ntrainer:\n  seq_len: 11264\n  max_steps: {planned}\n"
                                         f"run:\n  name: x\n")
        (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in (last - 20, last)))
        (tmp_path / "calls").unlink(missing_ok=True)
        done = run_script(tmp_path, env, "mixed-naive-long", check=False)
        assert (done.returncode == 0) == runs and (tmp_path / "calls").exists() == runs, (planned, last, done.stdout)
        if not runs:
            assert "first stage stopped at step 300 of 330: run 'mixed-naive continue'" in done.stdout


def test_a_run_on_another_bpe_puts_its_grid_beside_but_not_its_loss_curve(tmp_path):
    """mixed-digits-eval: mixed-base's grid beside its own, but no loss curve beside it (per-token
    losses of two BPEs do not compare, and eval_loss_by_position.py refuses them); mixed-base-eval
    keeps both; a loss curve that is not committed (mixed-scaled's, from an empty EVALS folder) is
    left out with a note. Read off what the script would run."""
    for case, loss_beside in (("mixed-digits-eval", []), ("mixed-base-eval", ["mixed-scaled"])):
        calls = tmp_path / f"calls-{case}"
        env = script_env(tmp_path, calls, EVALS=str(REPO / "benchmarks" / "evals"))
        run_script(tmp_path, env, case)
        loss, grid = calls.read_text().splitlines()   # the curve first: a call cut short in the grid keeps it
        assert "eval_passkey.py" in grid and "--beside" in grid
        assert "eval_loss_by_position.py" in loss
        assert re.findall(r"--beside \S+loss_by_position_long_context_passkey_([\w-]+)\.json", loss) == loss_beside
    env["EVALS"] = str(tmp_path / "evals")
    shown = run_script(tmp_path, env, "mixed-base-eval").stdout
    assert "loss_by_position_long_context_passkey_mixed-scaled.json is not committed" in shown
    assert "--beside" not in calls.read_text().splitlines()[-2]


def test_a_second_stage_branches_from_its_own_first_stage(tmp_path):
    """mixed-digits-whole branches from mixed-digits' step 1,700 with the README's stage-2 preset alone
    (MIXED_WHOLE's units); mixed-whole from mixed-base's, with mixed-base's settings and MIXED_WHOLE; on
    a machine without that first stage, the script names the run to make first. Read off what the
    script would run."""
    whole = " ".join(script_overrides("MIXED_WHOLE"))
    for case, first, settings in (("mixed-digits-whole", "mixed-digits", "experiment=long-context-retrieval-long "),
                                  ("mixed-whole", "mixed-base", "experiment=long-context-mixed ")):
        env = script_env(tmp_path, tmp_path / f"calls-{case}")
        missing = run_script(tmp_path, env, case, check=False)
        assert missing.returncode == 2 and f"run '{first}' first on this machine" in missing.stdout
        checkpoint = tmp_path / "runs" / "long-context" / first / "checkpoints" / "step_00001700.pt"
        checkpoint.parent.mkdir(parents=True)
        checkpoint.write_bytes(b"")
        run_script(tmp_path, env, case)
        call = (tmp_path / f"calls-{case}").read_text()
        assert f"run.dir=runs/long-context/{case} resume={checkpoint.relative_to(tmp_path)}" in call
        assert call.rstrip().endswith(whole if first == "mixed-base" else "trainer.progress=false") and settings in call
        assert ("model.rope_theta=500000" in call) == (first == "mixed-base")   # the preset has it


WARM = "experiment=long-context-mixed-naive-h100 run.dir=runs/long-context/mixed-digits-8k"


README_RUN = "experiment=long-context-retrieval run.dir=runs/long-context/readme"
ATOMIC = " attention.backward_kernel=triton attention.deterministic=false"
FLOOR = " optim.min_lr=6.0e-6"   # stage 2 alone
BATCH_2 = " trainer.grad_accum=2"   # stage 2 alone
BATCH_8 = " trainer.grad_accum=8"   # stage 1 alone


@pytest.mark.parametrize("case, first_run, first, tail, second_tail, beside", [
    ("mixed-digits-warm8k", "mixed-digits-8k", WARM, " attention=flash", "", "mixed-digits-whole"),
    ("mixed-digits-warm8k-seed2026", "mixed-digits-8k-seed2026", WARM + "-seed2026", " attention=flash seed=2026",
     " seed=2026", "mixed-digits-seed2026"),
    ("readme", "readme-8k", README_RUN + "-8k", "", "", "mixed-digits-warm8k"),
    ("readme-keys8", "readme-keys8-8k", README_RUN + "-keys8-8k", " data.passkey.key_digits=8",
     " data.passkey.key_digits=8", "mixed-digits-warm8k"),
    ("readme-triton-bwd", "readme-triton-bwd-8k", README_RUN + "-triton-bwd-8k", " attention.backward_kernel=triton",
     " attention.backward_kernel=triton", "mixed-digits-warm8k"),
    ("readme-seed2026", "readme-seed2026-8k", README_RUN + "-seed2026-8k", " seed=2026", " seed=2026",
     "mixed-digits-warm8k"),
    ("readme-triton-atomic", "readme-triton-atomic-8k", README_RUN + "-triton-atomic-8k", ATOMIC, ATOMIC,
     "mixed-digits-warm8k"),
    ("readme-triton-atomic-seed2026", "readme-triton-atomic-seed2026-8k", README_RUN + "-triton-atomic-seed2026-8k",
     ATOMIC + " seed=2026", ATOMIC + " seed=2026", "mixed-digits-warm8k"),
    ("readme-floor", "readme-floor-8k", README_RUN + "-floor-8k", "", FLOOR, "mixed-digits-warm8k"),
    ("readme-floor-seed2026", "readme-floor-seed2026-8k", README_RUN + "-floor-seed2026-8k", " seed=2026",
     " seed=2026" + FLOOR, "mixed-digits-warm8k"),
    ("readme-batch2", "readme-batch2-8k", README_RUN + "-batch2-8k", "", BATCH_2, "mixed-digits-warm8k"),
    ("readme-batch2-seed2026", "readme-batch2-seed2026-8k", README_RUN + "-batch2-seed2026-8k", " seed=2026",
     " seed=2026" + BATCH_2, "mixed-digits-warm8k"),
    ("readme-stage1-batch8", "readme-stage1-batch8-8k", README_RUN + "-stage1-batch8-8k", BATCH_8, "",
     "mixed-digits-warm8k"),
])
def test_the_warm_8k_recipe_branches_the_readme_stage_2_from_a_stage_1_in_8k_windows(tmp_path, case, first_run, first,
                                                                                      tail, second_tail, beside):
    """mixed-digits-warm8k: stage 1 is naive's H100 preset (the recipe in 8,192-token windows, 4 a
    step) with attention=flash to its own 1,700 steps; stage 2 the README's stage-2 preset, branched
    from that run's step 1,700 at its 32,768 tokens; its grid beside mixed-digits-whole's. With
    -seed2026 both stages from seed 2,026, beside the 32K stage 1's run from that seed. `readme` is
    the same two stages as the README's presets and commands run them (stage 1 is
    experiment=long-context-retrieval), beside mixed-digits-warm8k; `readme-keys8` that with 8-digit
    keys in both stages, `readme-triton-bwd` with the Triton backward, `readme-seed2026` from seed
    2,026, `readme-triton-atomic[-seed2026]` with the Triton backward adding dQ in arrival order
    (README_WITH), `readme-floor[-seed2026]` with stage 2 alone annealed to 6e-6 and
    `readme-batch2[-seed2026]` with stage 2 alone two windows a step (README_STAGE_2_WITH), and
    `readme-stage1-batch8` with stage 1 alone eight windows a step (README_STAGE_1_WITH). Read off
    what the script would run."""
    if case.startswith("readme-"):   # a README_WITH change (the tail): the preset takes it
        import yaml

        for preset, overrides in (("long-context-retrieval", tail), ("long-context-retrieval-long", second_tail)):
            changed = composed_with(preset, overrides.split())
            for key, value in (override.split("=") for override in overrides.split()):
                assert OmegaConf.select(changed, key) == yaml.safe_load(value), (preset, key)
    env = script_env(tmp_path, tmp_path / "calls", EVALS=str(tmp_path / "evals"))
    run_script(tmp_path, env, case)
    (stage_1,) = (tmp_path / "calls").read_text().splitlines()
    assert f"{first} resume=auto " in stage_1
    assert stage_1.endswith(f"trainer.progress=false{tail}") and "max_steps" not in stage_1
    missing = run_script(tmp_path, env, f"{case}-long", check=False)
    assert missing.returncode == 2 and f"run '{first_run}' first on this machine" in missing.stdout
    checkpoint = tmp_path / "runs" / "long-context" / first_run / "checkpoints" / "step_00001700.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"")
    run_script(tmp_path, env, f"{case}-long")
    second = (tmp_path / "calls").read_text().splitlines()[1]
    assert (f"experiment=long-context-retrieval-long run.dir=runs/long-context/{case} "
            f"resume={checkpoint.relative_to(tmp_path)} ") in second and "seq_len" not in second
    assert second.endswith(f"trainer.progress=false{second_tail}")
    run_script(tmp_path, env, f"{case}-eval")
    evaluated = "\n".join((tmp_path / "calls").read_text().splitlines()[2:])
    assert f"runs/long-context/{case} " in evaluated and "--attention flash" in evaluated
    assert re.findall(r"--beside \S+_long_context_passkey_(\S+)\.json", evaluated)[:1] == [beside]
    # a run trained on keys of another length is asked its own length too, in a grid of its own name
    grids = [line for line in evaluated.splitlines() if "eval_passkey.py" in line]
    digits = re.findall(r"key_digits=(\d+)", tail)
    assert len(grids) == 1 + len(digits)
    assert all(f"--key-digits {d} --name long_context_passkey_{case}-eval{d} " in grids[1] for d in digits)


@pytest.mark.parametrize("name, array, override", [("mixed-digits-5m", "MIXED_BASE_5M", "model.rope_theta=5000000"),
                                                   ("mixed-digits-seed2026", "MIXED_SEED_2026", "seed=2026"),
                                                   ("mixed-digits-last", "MIXED_ASK_LAST", "data.passkey.ask_last=true"),
                                                   ("mixed-digits-prope", "MIXED_PROPE", "model.rope_fraction=0.75")])
def test_a_recipe_variant_is_the_readme_recipe_with_one_override(tmp_path, name, array, override):
    """mixed-digits-5m, mixed-digits-seed2026 and mixed-digits-last: both of the README's presets, each
    with one override (RoPE base 5,000,000; seed 2,026; every question at its document's end) and
    nothing else, in a run of its own (stage 2 only once stage 1 is done), evaluated beside
    mixed-digits-whole (its grid and, the BPE being the same, its loss curve). Read off what the
    script would run."""
    import yaml

    from data.sources.passkey import PasskeySource
    from training.config import compose
    from training.config.checks import validate_config

    assert script_overrides(array) == [override]
    key, value = override.split("=")
    for preset in ("long-context-retrieval-32k", "long-context-retrieval-long"):
        readme = compose([f"experiment={preset}"])
        cfg = compose([f"experiment={preset}", override])
        validate_config(cfg)
        PasskeySource.from_config(cfg.data.passkey)   # its documents' settings hold together
        assert OmegaConf.select(cfg, key) == yaml.safe_load(value) != OmegaConf.select(readme, key)
        OmegaConf.update(cfg, key, OmegaConf.select(readme, key))
        assert OmegaConf.to_container(cfg) == OmegaConf.to_container(readme)

    calls = tmp_path / "calls"
    env = script_env(tmp_path, calls, EVALS=str(REPO / "benchmarks" / "evals"))
    run_script(tmp_path, env, name)
    run = tmp_path / "runs" / "long-context" / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("trainer:\n  max_steps: 1700\n")
    for last, runs in ((1500, False), (1700, True)):
        (run / "metrics.jsonl").write_text(f'{{"step": {last}, "loss": 1.0}}\n')
        done = run_script(tmp_path, env, f"{name}-long", check=False)
        assert (done.returncode == 0) == runs, done.stdout
    first, second = calls.read_text().splitlines()
    assert f"experiment=long-context-retrieval-32k run.dir=runs/long-context/{name} resume=auto" in first
    assert f"experiment=long-context-retrieval-long run.dir=runs/long-context/{name} resume=continue" in second
    for call in (first, second):
        assert call.split("trainer.progress=false ")[1].split() == [override]
    calls.unlink()
    run_script(tmp_path, env, f"{name}-eval")
    loss, grid = calls.read_text().splitlines()
    for call in (loss, grid):
        assert re.findall(r"--beside \S+_long_context_passkey_(\S+)\.json", call) == ["mixed-digits-whole"]
    assert f"{run.relative_to(tmp_path)} --attention flash" in grid
    # EVAL_PRECISION=fp32: the same grid once more in float32, beside the bf16 one just written
    calls.unlink()
    run_script(tmp_path, {**env, "EVAL_PRECISION": "fp32"}, f"{name}-eval")
    *_, bf16, fp32 = calls.read_text().splitlines()
    assert bf16 == grid and "--precision" not in bf16
    # 2K-16K: 32K in float32 takes longer than a call (the script's evaluate)
    assert fp32.replace(" --precision fp32", "").replace(f"{name}-fp32 ", f"{name} ").split(" --beside")[0] == \
        grid.split(" --beside")[0].replace(" 16384 32768 ", " 16384 ")
    assert fp32.endswith(f"--beside {tmp_path}/out/passkey_long_context_passkey_{name}.json")


@pytest.mark.slow
def test_the_mixed_cpu_variant_trains_and_writes_the_grid(tmp_path, cache_dir):  # noqa: F811
    """experiment=long-context-mixed-cpu: the mixed recipe's data (units cut into documents of one
    key, the document mask) through training and the passkey grid, in seconds."""
    cfg = composed("long-context-mixed-cpu")
    p = cfg.data.passkey
    assert cfg.data.document_mask and cfg.data.windows == "fixed" and p.length == cfg.trainer.seq_len
    assert composed("long-context-mixed").data.passkey.pairs == p.pairs == 1
    run = tmp_path / "run"
    assert run_in_process(["experiment=long-context-mixed-cpu", f"run.dir={run}", f"data.cache_dir={cache_dir}",
                           "trainer.progress=false"]) == 0
    out = tmp_path / "eval"
    eval_passkey.main([str(run), "--lengths", "128", "512", "--depths", "0", "1", "--trials", "2", "--out", str(out),
                       "--name", "mixed"])
    grid = json.loads((out / "passkey_mixed.json").read_text())
    assert grid["trained_seq_len"] == 512 and grid["why_not"] == [None, None]
    assert all(0 <= a <= 1 for row in grid["accuracy"] for a in row) and (out / "passkey_mixed.png").exists()
    eval_passkey_documents.main([str(run), "--lengths", "128", "512", "--fresh-lengths", "300", "--docs", "2",
                                 "--out", str(out), "--name", "mixed"])
    rows = json.loads((out / "passkey_documents_mixed.json").read_text())["rows"]
    assert [(r["length"], r["trained_at"], "seen" in r) for r in rows] == [(128, True, True), (512, True, True),
                                                                           (300, False, False)]
    assert all(0 <= r[k] <= 1 and r[f"{k}_docs"] == 2 for r in rows for k in ("seen", "fresh") if k in r)
    with pytest.raises(ValueError, match=r"^--fresh-lengths 50: a dense document needs at least \d+ tokens"):
        eval_passkey_documents.main([str(run), "--lengths", "128", "--fresh-lengths", "50", "--out", str(out / "short"),
                                     "--name", "mixed"])
    assert not (out / "short").exists()   # refused before any document was scored


@pytest.mark.slow
def test_the_readme_recipe_s_second_stage_branches_to_longer_windows_on_a_cpu(tmp_path, cache_dir, capsys):  # noqa: F811
    """The README's recipe's two commands in miniature (long-context-mixed-cpu): stage 1 in 256-token
    windows, 2 a step; stage 2 branched from its last checkpoint (resume=<file>) into a folder of its
    own at 512 tokens, 1 a step, on other units, its lineage recording what changed; the same
    command again refused in one line that says resume=auto, which goes on with the branch; stage 2
    without resume=<file> refused in one line that names it."""
    common = ["experiment=long-context-mixed-cpu", f"data.cache_dir={cache_dir}", "trainer.progress=false",
              "trainer.eval_every=4", "trainer.ckpt_every=4", "trainer.log_every=2"]
    first, second = tmp_path / "stage1", tmp_path / "stage2"
    assert run_in_process([*common, f"run.dir={first}", "trainer.max_steps=4", "trainer.seq_len=256",
                           "trainer.grad_accum=2", "trainer.batch_size=2", "data.passkey.length=256",
                           "data.passkey.pieces=[1,2]"]) == 0
    checkpoint = first / "checkpoints" / "step_00000004.pt"
    stage_2 = [*common, f"run.dir={second}", "trainer.max_steps=8", "trainer.batch_size=2", "data.allow_changed=true",
               "data.passkey.pieces=[1,1,4]"]
    assert run_in_process([*stage_2, f"resume={checkpoint}"]) == 0
    (row,) = [json.loads(line) for line in (second / "lineage.jsonl").read_text().splitlines()]
    assert row["event"] == "branch" and row["step"] == 4 and row["parent"]["step"] == 4
    assert row["changes"]["trainer.seq_len"] == [256, 512] and row["changes"]["trainer.grad_accum"] == [2, 1]
    steps = [json.loads(line)["step"] for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] > 4 and steps[-1] == 8
    capsys.readouterr()
    assert run_in_process([*stage_2, f"resume={checkpoint}"]) == 2
    assert "continue this one with resume=auto" in capsys.readouterr().err.strip().splitlines()[-1]
    assert run_in_process([*stage_2, "trainer.max_steps=10", "allow_changes=[trainer.max_steps]", "resume=auto"]) == 0
    assert json.loads((second / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 10
    assert run_in_process([*stage_2, f"run.dir={tmp_path / 'alone'}", "resume=continue"]) == 2
    assert "pass resume=<the earlier stage's checkpoint> to branch" in capsys.readouterr().err


@pytest.mark.parametrize("ask_last", [False, True])
def test_a_training_document_is_asked_its_last_question_as_the_eval_asks(ask_last):
    """eval_passkey_documents splits a dense document at its last question: the prompt is the text up
    to "... key is", the answer the key after a space, and the documents it calls seen are the run's
    own of that length, in training order."""
    from data.retrieval import dense_document
    from data.sources.passkey import PasskeySource
    from data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    source = PasskeySource(6, 512, None, 5, seed=3, kind="dense", pairs=1, pieces=[1, 4],
                           ask_last=ask_last).for_tokenizer(tok)
    rng = np.random.default_rng(3)
    built = [(length, *dense_document(length, 1, 5, rng, source.count_tokens, ask_last))
             for _, length, _ in source.layout()]
    for length, text, (pair,) in built:
        prompt, answer = eval_passkey_documents.question_ids(text, tok)
        assert bytes(prompt).decode().endswith(f"What is the {pair.name} key? The {pair.name} key is")
        assert bytes(answer).decode() == f" {pair.key}" and text.startswith(bytes(prompt + answer).decode())
        assert len(prompt) == len(tok.encode(text[: len(bytes(prompt).decode())]))
    seen = eval_passkey_documents.seen_documents(source, {128}, 3)
    assert seen == {128: [text for length, text, _ in built if length == 128][:3]}
