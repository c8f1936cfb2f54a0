"""The bytes, BPE and pretrained tokenizers: round trips, BPE caching, bad settings."""
import glob
import shlex
import textwrap
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from data.sources.files import FilesSource
from data.tokenizer import EOT_TOKEN, ByteTokenizer, build_tokenizer, token_dtype

TEXT = "def f(x):\n    return x  # naïve ✓ 😀\n"


@pytest.fixture
def source(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for module in (textwrap, shlex, glob):   # ~40 KB of real text
        (folder / f"{module.__name__}.txt").write_text(Path(module.__file__).read_text())
    return FilesSource(OmegaConf.create({"paths": [str(folder)]}), tmp_path / "cache")


def bpe(source, tmp_path, vocab_size=320, **more):
    cfg = OmegaConf.create({"name": "bpe", "vocab_size": vocab_size, "min_frequency": 2, "train_max_bytes": None, **more})
    return build_tokenizer(cfg, source, tmp_path / "cache", progress=False)


def test_bytes_round_trip_and_eot():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode()) and tok.decode(ids) == TEXT
    assert tok.decode(ids + [tok.eot_id]) == TEXT + EOT_TOKEN
    assert [a.tolist() for a in tok.encode_arrays([TEXT, ""])] == [ids, []]
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])


def test_bpe_trains_once_per_corpus_and_round_trips(source, tmp_path):
    tok = bpe(source, tmp_path)
    assert tok.vocab_size == 320 and tok.decode([tok.eot_id]) == EOT_TOKEN
    assert tok.decode(tok.encode(TEXT)) == TEXT                    # byte-level: any text survives
    assert len(tok.encode("    def __init__(self):")) < 23   # fewer tokens than bytes: merges learned
    stamp = tok.path.stat().st_mtime_ns
    again = bpe(source, tmp_path)
    assert again.path == tok.path and tok.path.stat().st_mtime_ns == stamp and again.fingerprint == tok.fingerprint
    assert bpe(source, tmp_path, vocab_size=300).path != tok.path
    with pytest.raises(ValueError, match="vocab_size=100 must exceed"):
        bpe(source, tmp_path, vocab_size=100)


def test_split_digits_makes_each_digit_a_token_and_is_its_own_cached_bpe(tmp_path):
    """With tokenizer.split_digits a number is one token a digit, however often the corpus repeats
    it; without, the BPE merges the numbers it sees often. Either way any text round-trips."""
    folder = tmp_path / "numbers"
    folder.mkdir()
    (folder / "keys.txt").write_text("The secret is 86556. Remember 86556, then 1024 and 2048.\n" * 200)
    source = FilesSource(OmegaConf.create({"paths": [str(folder)]}), tmp_path / "cache")
    merged, split = bpe(source, tmp_path), bpe(source, tmp_path, split_digits=True)
    assert split.path != merged.path and split.fingerprint != merged.fingerprint
    assert bpe(source, tmp_path, split_digits=False).path == merged.path   # the key as before the option
    for number in (" 86556", " 1024", " 20260"):
        digits = [split.decode([t]) for t in split.encode(number)]
        assert digits == [" ", *number.strip()], digits
        assert merged.decode(merged.encode(number)) == number == split.decode(split.encode(number))
    assert len(merged.encode(" 86556")) < 5                                   # seen 400 times: merged
    assert split.decode(split.encode(TEXT + " 123abc4")) == TEXT + " 123abc4"


def test_pretrained_loads_any_tokenizer_json(source, tmp_path):
    trained = bpe(source, tmp_path)
    cfg = OmegaConf.create({"name": "pretrained", "path": str(trained.path), "eot_token": EOT_TOKEN})
    tok = build_tokenizer(cfg, source, tmp_path / "cache", progress=False)
    assert tok.encode(TEXT) == trained.encode(TEXT) and tok.eot_id == trained.eot_id
    assert [a.tolist() for a in tok.encode_arrays([TEXT])] == [tok.encode(TEXT)]
    with pytest.raises(ValueError, match="tokenizer file not found"):
        build_tokenizer(OmegaConf.create({"name": "pretrained", "path": str(tmp_path / "none.json")}), source, tmp_path)
    # A tokenizer without the end-of-document token says how to name the one it has.
    plain = Tokenizer(models.BPE(unk_token="<unk>"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.train_from_iterator(["a b c"], trainers.BpeTrainer(vocab_size=50, special_tokens=["<unk>", "</s>"], show_progress=False))
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(ValueError, match="tokenizer.eot_token"):
        build_tokenizer(OmegaConf.create({"name": "pretrained", "path": str(tmp_path / "plain.json")}), source, tmp_path)
    eos = build_tokenizer(OmegaConf.create({"name": "pretrained", "path": str(tmp_path / "plain.json"), "eot_token": "</s>"}),
                          source, tmp_path)
    assert eos.eot_id == 1


def test_bad_tokenizer_settings(source, tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer.name 'wordpiece'"):
        build_tokenizer(OmegaConf.create({"name": "wordpiece"}), source, tmp_path)
    with pytest.raises(ValueError, match="needs tokenizer.path"):
        build_tokenizer(OmegaConf.create({"name": "pretrained", "path": None}), source, tmp_path)


def test_token_dtype_by_vocab():
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_bpe_training_and_tokenizing_print_no_frames_or_blank_lines_off_a_terminal(source, tmp_path, capfd):
    """With progress on, but stdout and stderr not terminals (a log file, here pytest's capture):
    the tokenizers library's bars would print blank lines and tqdm `\\r` frames; neither appears."""
    from data.cache import load_or_build

    cfg = OmegaConf.create({"name": "bpe", "vocab_size": 320, "min_frequency": 2, "train_max_bytes": None})
    tok = build_tokenizer(cfg, source, tmp_path / "cache", progress=True)
    load_or_build(tmp_path / "cache", source.for_tokenizer(tok), tok, progress=True)
    out, err = capfd.readouterr()
    assert "\r" not in out + err and "\n\n" not in "\n" + out and "\n\n" not in "\n" + err, (out, err)
