"""scripts/generate.py on a tiny trained run: batches, stop strings, JSONL, the context limit."""
import json
import subprocess
import sys

import pytest
import torch

from tests.trainrun import REPO, run_in_process, subprocess_env, tiny_overrides

sys.path.insert(0, str(REPO / "scripts"))

import generate  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    assert run_in_process(tiny_overrides(root / "tiny", root / "cache", steps=2, **{"model.max_seq_len": 96})) == 0
    return root / "tiny"


def test_greedy_batch_matches_the_model_and_jsonl(run_dir, tmp_path):
    from training.builders import load_model_for_eval

    out = tmp_path / "out.jsonl"
    args = [str(run_dir), "--device", "cpu", "--prompt", "def f(x):", "--prompt", "import os",
            "--prompt", "class A:", "--temperature", "0", "--max-new-tokens", "8", "--ignore-eot",
            "--jsonl", str(out)]
    results = generate.main(args)   # the first two prompts have 9 tokens: one batch
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["def f(x):", "import os", "class A:"]
    assert all(r["new_tokens"] == 8 and r["stop_reason"] == "length" for r in rows)
    assert [r["completion"] for r in rows] == [r["completion"] for r in results]
    # the finished run's weights-only export generates the same
    weights = [str(run_dir / "model.safetensors"), *args[1:-2]]
    assert [r["completion"] for r in generate.main(weights)] == [r["completion"] for r in results]
    # the same tokens as greedy argmax over the full sequence, one prompt at a time
    model, _, tok = load_model_for_eval(sorted((run_dir / "checkpoints").glob("*.pt"))[-1], device="cpu")
    for row in rows:
        ids = tok.encode(row["prompt"])
        for _ in range(8):
            logits = model(torch.tensor([ids]))[0, -1, :tok.vocab_size]
            ids.append(int(logits.argmax()))
        assert tok.decode(ids[len(tok.encode(row["prompt"])):]) == row["completion"]


def test_sampling_is_seeded_and_stop_strings_cut(run_dir, capsys):
    base = [str(run_dir), "--device", "cpu", "--prompt", "x = ", "--num-samples", "3", "--max-new-tokens", "12",
            "--temperature", "1.5", "--ignore-eot", "--batch-size", "2"]   # batches of 2 and 1
    a, b = generate.main(base + ["--seed", "3"]), generate.main(base + ["--seed", "3"])
    assert a == b and len(a) == 3
    text = a[0]["completion"]
    stop = text[4:6]     # a stop string known to occur in the first sample
    cut = generate.main(base + ["--seed", "3", "--stop", stop])
    assert cut[0]["stop_reason"] == "stop" and cut[0]["completion"] == text[:text.find(stop)]
    assert "=== prompt 1, sample 3" in capsys.readouterr().out


def test_too_long_prompt_and_bad_options_exit_2(run_dir, tmp_path):
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("a" * 200)     # bytes tokenizer: 200 tokens > max_seq_len 96
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(run_dir), "--device", "cpu",
                           "--prompt-file", str(long_prompt)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: prompt 1 has 200 tokens; the model's context is 96 "
                                   "(model.max_seq_len), leaving no room to generate")
    for bad, message in ((["--top-p", "0"], "top_p=0.0"), (["--temperature", "-1"], "temperature"),
                         ([], "no prompt")):
        with pytest.raises(ValueError, match=message):
            generate.main([str(run_dir), "--device", "cpu", *(["--prompt", "a"] if bad else []), *bad])


def test_damaged_weights_are_refused_not_run(run_dir, tmp_path):
    """A model.safetensors whose tensor bytes changed after it was written (a flipped byte in the
    middle, past the header) fails its stored checksum in one line, as a damaged checkpoint does."""
    data = bytearray((run_dir / "model.safetensors").read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    damaged = tmp_path / "model.safetensors"
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"weights file {damaged} is corrupt: its tensors do not match the stored checksum"):
        generate.main([str(damaged), "--device", "cpu", "--prompt", "a", "--max-new-tokens", "2"])
    generate.main([str(run_dir / "model.safetensors"), "--device", "cpu", "--prompt", "a", "--max-new-tokens", "2"])


def test_a_limit_past_the_context_is_said(run_dir, capsys):
    """--max-new-tokens beyond what the context leaves after the prompt: decoding stops at the
    context, and the tool says so instead of cutting the request silently."""
    generate.main([str(run_dir), "--device", "cpu", "--prompt", "ab", "--max-new-tokens", "1000", "--temperature", "0"])
    err = capsys.readouterr().err
    assert "note: --max-new-tokens 1,000: the model's context (96, model.max_seq_len) leaves 94 after the longest " \
           "prompt (2 tokens); generating at most that" in err, err
