"""Dense-retrieval documents (data/retrieval.py, data.passkey.kind=dense): every question's answer is
the key stated last under its name, distances spread over the whole document, lengths exact in the
run's tokens, the eval's sentences are the trained ones, and under data.windows=fixed each training
window is one whole document."""
import re
import shlex
import textwrap
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from data.passkey import KEY_SENTENCE, QUESTION, passkey_prompt
from data.retrieval import _fill, _pad, dense_document, question_text, statement_text
from data.sampler import windows_to_batch
from data.sources.files import FilesSource
from data.sources.passkey import PasskeySource
from data.tokenizer import ByteTokenizer, build_tokenizer
from tests.test_data_sources import bundle_for

STATEMENT = re.compile(r"Remember this: the (\w+) key is (\d+)\. The \1 key is \2\.")
ASKED = re.compile(r"What is the (\w+) key\? The \1 key is (\d+)\.")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE trained on real text (~40 KB of the standard library's source)."""
    tmp = tmp_path_factory.mktemp("bpe")
    (tmp / "texts").mkdir()
    for module in (textwrap, shlex):
        (tmp / "texts" / f"{module.__name__}.txt").write_text(Path(module.__file__).read_text())
    source = FilesSource(OmegaConf.create({"paths": [str(tmp / "texts")]}), tmp / "cache")
    cfg = OmegaConf.create({"name": "bpe", "vocab_size": 400, "min_frequency": 2, "train_max_bytes": None})
    return build_tokenizer(cfg, source, tmp / "cache", progress=False)


def tokenizers(bpe):
    return {"bytes": ByteTokenizer(), "bpe": bpe}


def events(text: str) -> list[tuple[int, str, str, str]]:
    """(character offset, 'state' or 'ask', name, key) in text order."""
    found = [(m.start(), "state", *m.groups()) for m in STATEMENT.finditer(text)]
    found += [(m.start(), "ask", *m.groups()) for m in ASKED.finditer(text)]
    return sorted(found)


@pytest.mark.parametrize("name", ["bytes", "bpe"])
@pytest.mark.parametrize("length,pairs", [(256, 2), (1024, 6), (4096, 24)])
def test_every_answer_is_the_key_stated_last_under_its_name(bpe, name, length, pairs):
    tok = tokenizers(bpe)[name]
    count = lambda s: len(tok.encode(s))  # noqa: E731
    rng = np.random.default_rng(1)
    for _ in range(5):
        text, found = dense_document(length, pairs, 5, rng, count)
        ids = tok.encode(text)
        assert len(ids) == length - 1                  # with its end-of-text token: one window of `length`
        latest, asked = {}, 0
        for _, what, who, key in events(text):
            if what == "state":
                latest[who] = key
            else:
                assert latest.get(who) == key, (who, key, latest.get(who))
                asked += 1
        assert asked == sum(p.question is not None for p in found) >= 1
        assert len(events(text)) == len(found) + asked  # nothing else reads as a statement or question
        for p in found:                                  # the token positions the pairs report are right
            assert tok.decode(ids[p.statement:]).lstrip().startswith("Remember this: the " + p.name)
            if p.question is not None:
                assert tok.decode(ids[p.question:]).lstrip().startswith(f"What is the {p.name} key? The {p.name} "
                                                                        f"key is {p.key}.")


def test_distances_spread_over_the_whole_document(bpe):
    count = lambda s: len(bpe.encode(s))  # noqa: E731
    rng, length = np.random.default_rng(0), 2048
    distances = []
    for _ in range(20):
        _, found = dense_document(length, 20, 5, rng, count)
        distances += [p.question - p.statement for p in found if p.question is not None]
    distances = np.array(distances) / length
    assert len(distances) >= 300
    assert distances.min() < 0.1 and distances.max() > 0.9
    counts = np.histogram(distances, bins=4, range=(0, 1))[0] / len(distances)
    assert (counts > 0.12).all(), counts              # every quarter of the window, not just short distances


@pytest.mark.parametrize("name", ["bytes", "bpe"])
def test_ask_last_ends_each_document_with_its_question(bpe, name):
    """data.passkey.ask_last: the one question ends its document (a few background words at most
    after its answer, as the eval's prompt ends with its question), its key at distances spread over
    the whole document; without it most questions sit far from the end."""
    tok = tokenizers(bpe)[name]
    count = lambda s: len(tok.encode(s))  # noqa: E731
    length = 1024
    for ask_last in (True, False):
        rng, tails, distances = np.random.default_rng(3), [], []
        for _ in range(40):
            text, (pair,) = dense_document(length, 1, 5, rng, count, ask_last=ask_last)
            asked = list(ASKED.finditer(text))
            assert len(asked) == 1 and asked[0].group(2) == pair.key and pair.question is not None
            tail = text[asked[0].end():]
            assert not STATEMENT.search(tail)
            tails.append(count(tail))
            distances.append((pair.question - pair.statement) / length)
        if ask_last:
            assert max(tails) <= 16, tails
            assert min(distances) < 0.25 and max(distances) > 0.75
        else:
            assert np.median(tails) > 100, tails


def test_ask_last_is_refused_where_a_document_has_several_keys():
    with pytest.raises(ValueError, match=r"data.passkey.ask_last: the question ends a document of one key, not of 2"):
        dense_document(1024, 2, 5, np.random.default_rng(0), len, ask_last=True)
    settings = {"num_docs": 4, "length": 512, "depths": None, "key_digits": 5, "seed": 0, "kind": "dense", "pairs": 1}
    for bad in ({"pairs": 2}, {"pieces": [1, 2], "piece_pairs": [1, 2]}, {"kind": "single", "pairs": None}):
        with pytest.raises(ValueError, match=r"data.passkey.ask_last: needs kind=dense with one key a document"):
            PasskeySource.from_config(OmegaConf.create(settings | bad | {"ask_last": True}))
    typical = len(statement_text("bako", "99999")) + len(question_text("bako", "99999"))
    refused = []   # "secret" is longer than "bako" in bytes: a document just long enough for the latter
    for seed in range(20):
        try:
            dense_document(typical + 4, 1, 5, np.random.default_rng(seed), len, ask_last=True)
        except ValueError as e:
            refused.append(str(e))
    assert refused and all(re.match(r"data.passkey.length=\d+: too short for the statement and question of key "
                                    r"'\d{5}' named 'secret' with data.passkey.ask_last", e) for e in refused)
    last = PasskeySource.from_config(OmegaConf.create(settings | {"ask_last": True}))
    assert last.fingerprint != PasskeySource.from_config(OmegaConf.create(settings)).fingerprint
    assert last.for_tokenizer(ByteTokenizer()).ask_last


def test_a_tokenizers_documents_are_those_of_counting_every_piece_afresh(bpe):
    """for_tokenizer remembers the counts of short pieces (data/sources/passkey.py): the documents are
    the same texts as with a count that encodes every piece each time, in far fewer encodes."""
    calls = []

    class Counted:
        def encode(self, text):
            calls.append(text)
            return bpe.encode(text)

    source = PasskeySource(30, 2048, None, 5, 0, kind="dense", pairs=1, pieces=[1, 4, 16])
    afresh = PasskeySource(30, 2048, None, 5, 0, kind="dense", pairs=1, pieces=[1, 4, 16],
                           count_tokens=lambda text: len(bpe.encode(text)))
    documents = list(source.for_tokenizer(Counted()).documents())
    assert len(documents) == 210 and documents == list(afresh.documents())
    assert len(calls) < 10 * len(documents)   # counted afresh, every piece: ~60 encodes a document


def test_padding_from_the_callers_count_is_padding_from_the_texts_own(bpe):
    """dense_document hands _pad the sum of its pieces' counts: the padded text is the one counting
    the text would give, with one whole-text encode instead of two; a sum that is not the text's
    count (a tokenizer that merges across pieces) is caught and the padding redone."""
    long_texts = []

    def count(text):
        if len(text) > 200:
            long_texts.append(text)
        return len(bpe.encode(text))

    words = [" alpha", " beta", " gamma", " delta", " epsilon"]
    text = " ".join(f"The key of bako{i} is {i:05d}." for i in range(8))
    want = _fill(text, count(text), 400, words, count)   # padded from the text's own count
    assert count(want) == 400 and want.startswith(text) and len(long_texts) == 2   # text, and this check
    long_texts.clear()
    assert _pad(text, 400, words, count, len(bpe.encode(text))) == want and len(long_texts) == 1
    for off in (-3, 5):
        assert _pad(text, 400, words, count, len(bpe.encode(text)) + off) == want


def test_the_eval_asks_in_the_trained_sentences(bpe):
    """A key named "secret" in a training document is exactly the eval's key sentence and question."""
    prompt, answer = passkey_prompt(200, 0.0, "12345", len)
    assert prompt.startswith(KEY_SENTENCE.format(key="12345")) and prompt.endswith(QUESTION)
    rng = np.random.default_rng(0)
    texts = [dense_document(1024, 12, 5, rng, lambda s: len(bpe.encode(s)))[0] for _ in range(20)]
    secret = [m for t in texts for m in ASKED.finditer(t) if m.group(1) == "secret"]
    assert secret and all(QUESTION + " " + m.group(2) in m.group(0) for m in secret)
    assert any(KEY_SENTENCE.format(key=m.group(2)).strip() in t for t in texts for m in STATEMENT.finditer(t)
               if m.group(1) == "secret")


@pytest.mark.parametrize("kwargs,match", [
    ({"pairs": None}, "data.passkey.pairs=None"),
    ({"pairs": 0}, "data.passkey.pairs=0"),
    ({"depths": [0.5]}, "data.passkey.depths"),
    ({"kind": "many"}, "data.passkey.kind='many'"),
    ({"pieces": [1, 3]}, "data.passkey.pieces=[1, 3]: each count must be >= 1 and divide data.passkey.length=512"),
    ({"pieces": [0]}, "data.passkey.pieces=[0]"),
    ({"kind": "single", "pairs": None, "pieces": [2]}, "data.passkey.pieces: only kind=dense"),
])
def test_bad_settings_are_refused_naming_the_key(kwargs, match):
    settings = {"num_docs": 4, "length": 512, "depths": None, "key_digits": 5, "seed": 0, "kind": "dense", "pairs": 4}
    with pytest.raises(ValueError, match=re.escape(match)):
        PasskeySource.from_config(OmegaConf.create(settings | kwargs))
    with pytest.raises(ValueError, match=re.escape("data.passkey.pairs=3: only kind=dense")):
        PasskeySource.from_config(OmegaConf.create(settings | {"kind": "single", "pairs": 3}))


def test_too_many_pairs_or_too_short_a_document_is_refused():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"data.passkey.pairs=5: at most 2 keys"):
        dense_document(300, 5, 5, rng, len)
    with pytest.raises(ValueError, match=r"data.passkey.length=64: a dense document needs at least"):
        dense_document(64, 1, 5, rng, len)


def test_fixed_windows_are_whole_documents_in_the_mix(tmp_path):
    """data=stdlib-passkey with dense documents and data.windows=fixed: the dense documents come
    first, so window k of the training stream is dense document k, end-of-text token and all."""
    length = 512
    data = {"name": "stdlib-passkey", "min_doc_bytes": 100_000, "max_bytes": 400_000, "val_fraction": 0.2,
            "windows": "fixed", "passkey": {"num_docs": 6, "length": length, "depths": None, "key_digits": 5,
                                            "seed": 0, "kind": "dense", "pairs": 3}}
    b = bundle_for(tmp_path, data, seq_len=length)
    sampler, eot = b.train, b.tokenizer.eot_id
    for k in range(6):
        window = sampler.window(k, epoch=3)
        assert window[length - 1] == eot and eot not in window[: length - 1]
        assert b.tokenizer.decode(window[:4].tolist()) in ("Reme", "The ")   # a document's first words
    assert b.tokenizer.decode(sampler.window(6, epoch=0)[:5].tolist()) != "Remem"  # then the corpus


def test_pieces_fill_each_fixed_window_with_documents_of_one_length(tmp_path):
    """data.passkey.pieces=[1, 4, 2]: unit k of `length` tokens is cut into 1, 4, 2, 1, ... documents,
    each whole (its end-of-text token last) and exactly length / n tokens, so that under
    data.windows=fixed window k holds those documents and nothing else; the document mask then
    reads each on its own."""
    length, cuts = 512, [1, 4, 2]
    data = {"name": "stdlib-passkey", "min_doc_bytes": 100_000, "max_bytes": 400_000, "val_fraction": 0.2,
            "windows": "fixed", "document_mask": True,
            "passkey": {"num_docs": 5, "length": length, "depths": None, "key_digits": 5, "seed": 0,
                        "kind": "dense", "pairs": 1, "pieces": cuts}}
    b = bundle_for(tmp_path, data, seq_len=length)
    eot = b.tokenizer.eot_id
    for k in range(5):
        window = b.train.window(k, epoch=1)
        n = cuts[k % len(cuts)]
        ends = np.flatnonzero(window[:length] == eot)
        assert ends.tolist() == [(j + 1) * length // n - 1 for j in range(n)]
        for j in range(n):
            text = b.tokenizer.decode(window[j * length // n : (j + 1) * length // n - 1].tolist())
            (stated,), (asked,) = STATEMENT.findall(text), ASKED.findall(text)
            assert stated == asked                     # one key, asked for in the same document
    x, _, doc_ids = windows_to_batch([b.train.window(1, epoch=1)], eot, return_doc_ids=True)
    assert doc_ids[0, :: length // 4].tolist() == [0, 1, 2, 3]
    source = PasskeySource(5, length, None, 5, 0, kind="dense", pairs=1, pieces=cuts)
    assert source.num_documents == 1 + 4 + 2 + 1 + 4 and len(source.names()) == source.num_documents
    assert source.fingerprint != PasskeySource(5, length, None, 5, 0, kind="dense", pairs=1).fingerprint


def test_piece_pairs_give_each_units_documents_their_own_keys(tmp_path):
    """data.passkey.piece_pairs=[3, 1, 1] beside pieces=[1, 4, 2]: the whole-window documents hold
    up to three keys each (more answers at long distances; where events crowd, the generator drops
    one), the cut ones one, each asked for in its own document; a list that does not match pieces
    is refused in one line, before any document is made."""
    length, cuts, keys = 1024, [1, 4, 2], [3, 1, 1]
    data = {"name": "stdlib-passkey", "min_doc_bytes": 100_000, "max_bytes": 400_000, "val_fraction": 0.2,
            "windows": "fixed", "document_mask": True,
            "passkey": {"num_docs": 4, "length": length, "depths": None, "key_digits": 5, "seed": 0,
                        "kind": "dense", "pairs": 1, "pieces": cuts, "piece_pairs": keys}}
    b = bundle_for(tmp_path, data, seq_len=length)
    for k in range(4):
        window = b.train.window(k, epoch=1)
        n = cuts[k % len(cuts)]
        for j in range(n):
            text = b.tokenizer.decode(window[j * length // n : (j + 1) * length // n - 1].tolist())
            stated, asked = STATEMENT.findall(text), ASKED.findall(text)
            assert sorted(asked) == sorted(stated), (k, j, text)
            assert (1 < len(stated) <= 3) if keys[k % len(keys)] == 3 else len(stated) == 1, (k, j, stated)
    plain = PasskeySource(4, length, None, 5, 0, kind="dense", pairs=1, pieces=cuts)
    assert PasskeySource(4, length, None, 5, 0, kind="dense", pairs=1, pieces=cuts, piece_pairs=keys).fingerprint \
        != plain.fingerprint
    assert PasskeySource(4, length, None, 5, 0, kind="dense", pairs=1, pieces=cuts, piece_pairs=[1, 1, 1]).names() \
        == plain.names()
    for bad in ([3, 1], [3, 0, 1]):
        with pytest.raises(ValueError, match="piece_pairs"):
            PasskeySource(4, length, None, 5, 0, kind="dense", pairs=1, pieces=cuts, piece_pairs=bad)
    with pytest.raises(ValueError, match="needs data.passkey.pieces"):
        PasskeySource(4, length, None, 5, 0, kind="dense", pairs=1, piece_pairs=[2])
