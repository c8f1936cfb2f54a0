"""trainer.passkey_probe: each evaluation logs passkey accuracy at the given prompt lengths, with
the same keys every time, and changes nothing the run computes."""
import json

import pytest

from tests.trainrun import cache_dir, run_in_process, tiny_overrides  # noqa: F401 (cache_dir is a fixture)


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_probe_is_logged_at_each_evaluation_and_changes_nothing_else(tmp_path, cache_dir, caplog):  # noqa: F811
    caplog.set_level("INFO")
    plain, probed = tmp_path / "plain", tmp_path / "probed"
    assert run_in_process(tiny_overrides(plain, cache_dir, steps=6, **{"trainer.eval_every": 3})) == 0
    assert run_in_process(tiny_overrides(probed, cache_dir, steps=6, **{"trainer.eval_every": 3,
                                                                       "trainer.passkey_probe": "[128,200]",
                                                                       "trainer.passkey_trials": 2})) == 0
    a, b = rows(plain), rows(probed)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]          # the probe draws nothing from the run's RNGs
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
    probes = [(r["step"], r["passkey_128"], r["passkey_200"]) for r in b if "passkey_128" in r]
    assert [s for s, *_ in probes] == [3, 6] and all(0 <= x <= 1 for _, *acc in probes for x in acc)
    assert not any(k.startswith("passkey_") for r in a for k in r)
    assert any("| passkey_128 " in r.getMessage() for r in caplog.records)


def test_the_same_keys_every_time():
    import numpy as np
    import torch

    from data.tokenizer import ByteTokenizer
    from training.loop.evaluate import passkey_probe

    class Oracle(torch.nn.Module):
        """Ranks first, at each position, the byte the prompt's own key has there: right exactly
        on prompts whose key it was told, so the probe's accuracy counts the keys it repeats."""
        def __init__(self, keys):
            super().__init__()
            self.keys = keys

        def forward(self, x):
            text = bytes(x[0].tolist()).decode()
            key = next(k for k in self.keys if f"key is {k}." in text)
            logits = torch.zeros(1, x.shape[1], 256)
            answer = f" {key}".encode()
            for i, byte in enumerate(answer):
                logits[0, x.shape[1] - len(answer) + i, byte] = 1.0
            return logits

    from data.passkey import random_key

    rng = np.random.default_rng(0)
    keys = [random_key(rng, 5) for _ in range(6)]
    model = Oracle(keys)
    first = passkey_probe(model, ByteTokenizer(), [150, 300], [0.0, 1.0], 1, torch.device("cpu"), "fp32")
    again = passkey_probe(model, ByteTokenizer(), [150, 300], [0.0, 1.0], 1, torch.device("cpu"), "fp32")
    assert first == again == {150: 1.0, 300: 1.0}
    with pytest.raises(StopIteration):   # another seed: other keys, which the oracle was not told
        passkey_probe(model, ByteTokenizer(), [150], [0.0], 1, torch.device("cpu"), "fp32", seed=1)


@pytest.mark.parametrize("overrides,match", [
    (["trainer.passkey_probe=[99999999]"], "trainer.passkey_probe"),
    (["trainer.passkey_probe=[0]"], "trainer.passkey_probe"),
    # a prompt of the model's whole length would run past it with its answer
    (["model.max_seq_len=4096", "trainer.passkey_probe=[4096]"], r"model.max_seq_len - 64 = 4032"),
])
def test_bad_probe_lengths_are_refused_in_one_line(overrides, match):
    from training.config import compose
    from training.config.checks import validate_config

    with pytest.raises(ValueError, match=match):
        validate_config(compose(["model=tiny", *overrides]))
    validate_config(compose(["model=tiny", "model.max_seq_len=4096", "trainer.passkey_probe=[4032]"]))


def test_a_probe_length_no_prompt_fits_is_refused_before_training(tmp_path, cache_dir, capsys):  # noqa: F811
    """A length under the shortest whole prompt (key sentence, question, answer) cannot be asked: it
    would log 0% at every evaluation. The shortest depends on the tokenizer, so the check comes once
    the data (and its tokenizer) is built, before the first step."""
    assert run_in_process(tiny_overrides(tmp_path / "run", cache_dir, **{"trainer.passkey_probe": "[10]"})) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: trainer.passkey_probe: 10 is shorter than the shortest passkey prompt ("), err
    assert not (tmp_path / "run" / "checkpoints").exists()
