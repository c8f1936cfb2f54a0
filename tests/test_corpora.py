"""Corpora of any shape: one big plain-text file trains with every tokenizer, the run keeps
its tokenizer so evaluation and generation need no corpus, and a moved token cache is found again."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from data.stream import split_corpus
from data.tokenizer import train_bpe
from tests.trainrun import run_in_process, tiny_overrides

PLAYS = "".join((Path(os.__file__).parent / name).read_text() for name in ("argparse.py", "textwrap.py"))


def test_too_few_documents_hold_out_the_last_tokens():
    offsets, is_val, how = split_corpus(np.array([0, 1000]), np.array([7], dtype=np.uint64), 0.05)
    assert how == "tokens" and offsets.tolist() == [0, 950, 1000] and is_val.tolist() == [False, True]
    # one big file beside a small one: whole documents cannot make a 5% split either
    offsets, is_val, how = split_corpus(np.array([0, 1000, 1010]), np.array([3, 7], dtype=np.uint64), 0.05)
    assert how == "tokens" and offsets.tolist() == [0, 960, 1000, 1010] and is_val.tolist() == [False, True, True]


def test_enough_documents_still_hold_out_whole_ones():
    offsets = np.arange(0, 2100, 100)   # 20 documents of 100 tokens
    out, is_val, how = split_corpus(offsets, np.arange(20, dtype=np.uint64), 0.1)
    assert how == "documents" and out is offsets and is_val.sum() == 2


@pytest.fixture(scope="module")
def plays(tmp_path_factory):
    """A folder holding one plain-text file, the most common corpus there is."""
    folder = tmp_path_factory.mktemp("plays")
    (folder / "plays.txt").write_text(PLAYS)
    return folder


def files_overrides(run_dir, cache_dir, folder, *extra) -> list[str]:
    base = [o for o in tiny_overrides(run_dir, cache_dir, steps=2) if not o.startswith("data.max_bytes")]
    return ["data=files", f"data.paths=[{folder}]", "trainer.eval_every=2", *base, *extra]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe", "pretrained"])
def test_one_text_file_trains_with_every_tokenizer(tmp_path, plays, caplog, tokenizer):
    from training.builders import load_model_for_eval

    extra = {"bytes": ["tokenizer=bytes"],
             "bpe": ["tokenizer=bpe", "tokenizer.vocab_size=400", "tokenizer.train_max_bytes=null"]}
    if tokenizer == "pretrained":   # any tokenizer.json of the tokenizers library; made here, offline
        train_bpe(iter([PLAYS]), 400, 2, tmp_path / "pretrained.json", show_progress=False)
        extra["pretrained"] = ["tokenizer=pretrained", f"tokenizer.path={tmp_path / 'pretrained.json'}"]
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="data.build")
    assert run_in_process(files_overrides(run_dir, cache, plays, *extra[tokenizer])) == 0
    assert "1 document(s), too few to hold out whole ones" in caplog.text
    assert (run_dir / "tokenizer.json").is_file() == (tokenizer != "bytes")

    # evaluation and generation load the model with neither the corpus nor its token cache
    moved = tmp_path / "elsewhere"
    shutil.copytree(run_dir, moved)
    shutil.rmtree(cache)
    if tokenizer == "pretrained":
        (tmp_path / "pretrained.json").unlink()
    model, cfg, tok = load_model_for_eval(moved / "model.safetensors", device="cpu")
    assert not cache.exists(), "nothing was re-tokenized"
    assert tok.decode(tok.encode("def main():")) == "def main():"
    assert model.config.vocab_size >= tok.vocab_size


def test_a_moved_token_cache_is_found_through_flashtrain_cache(tmp_path, plays, monkeypatch):
    import data.cache
    from training.builders import load_model_for_eval

    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    assert run_in_process(files_overrides(run_dir, cache, plays)) == 0
    shutil.move(cache, tmp_path / "moved-cache")
    monkeypatch.setenv("FLASHTRAIN_CACHE", str(tmp_path / "moved-cache"))
    _, cfg, _ = load_model_for_eval(run_dir / "checkpoints" / "step_00000002.pt", device="cpu")
    assert cfg.data.cache_dir == str(tmp_path / "moved-cache")

    def no_build(*args, **kwargs):
        raise AssertionError("the corpus was tokenized again")
    monkeypatch.setattr(data.cache, "build", no_build)
    from training.builders import build_data
    bundle = build_data(cfg, seq_len=64, seed=cfg.seed)
    assert bundle.val_split == "tokens" and not cache.exists()
