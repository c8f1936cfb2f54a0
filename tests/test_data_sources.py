"""Every data source on small local files, the cache's reuse and keys, and each bad input."""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from training.builders import build_data
from data.passkey import passkey_prompt

BYTES = {"name": "bytes"}


def bundle_for(tmp_path, data: dict, seq_len=32, tokenizer=BYTES):
    cfg = OmegaConf.create({
        "data": {"val_fraction": 0.2, "cache_dir": str(tmp_path / "cache"), "verify_cache": True, **data},
        "tokenizer": tokenizer,
    })
    return build_data(cfg, seq_len=seq_len, seed=0, progress=False)


def documents(bundle) -> list[str]:
    """Every cached document decoded, EOT stripped (cache order)."""
    c, tok = bundle.cache, bundle.tokenizer
    return [tok.decode(c.tokens[a : b - 1].tolist()) for a, b in zip(c.offsets[:-1], c.offsets[1:])]


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "txt" / "sub").mkdir(parents=True)
    for i in range(4):
        (root / "txt" / f"doc{i}.txt").write_text(f"text file {i}. " * 40)
    (root / "txt" / "sub" / "nested.md").write_text("nested markdown. " * 40)
    (root / "txt" / ".hidden.txt").write_text("never read")
    (root / "txt" / "image.png").write_bytes(b"\x89PNG")
    with open(root / "records.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"body": f"json record {i}. " * 30, "id": i}) + "\n")
    pq.write_table(pa.table({"body": [f"parquet row {i}. " * 30 for i in range(5)], "n": list(range(5))}), root / "rows.parquet")
    return root


def test_files_txt_folder_one_document_per_file(tmp_path, corpus):
    b = bundle_for(tmp_path, {"name": "files", "paths": [str(corpus / "txt")], "text_extensions": [".txt", ".md"]})
    docs = sorted(documents(b))
    assert docs == sorted([f"text file {i}. " * 40 for i in range(4)] + ["nested markdown. " * 40])
    assert b.fingerprint.startswith("files-")


def test_files_jsonl_and_parquet_one_document_per_record(tmp_path, corpus):
    b = bundle_for(tmp_path, {"name": "files", "paths": [str(corpus / "records.jsonl"), str(corpus / "rows.parquet")],
                              "text_field": "body"})
    expected = [f"json record {i}. " * 30 for i in range(6)] + [f"parquet row {i}. " * 30 for i in range(5)]
    assert sorted(documents(b)) == sorted(expected)


def test_local_record_files_datasets_cannot_read_are_named_with_the_reason(tmp_path, capfd):
    """`datasets` says 'An error occurred while generating the dataset' and keeps the reason in the
    exception's cause; the one line names the user's files and gives that reason, and is the only
    error said (the builders log their own, naming the file but not what to do)."""
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "some text"}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"other": 3}) + "\n")
    with pytest.raises(ValueError, match=(rf"cannot read {tmp_path / 'a.jsonl'}, {tmp_path / 'b.jsonl'} as json "
                                          r"records: Couldn't cast .* because column names don't match")):
        bundle_for(tmp_path, {"name": "files", "paths": [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
                              "text_field": "body"})
    (tmp_path / "torn.parquet").write_bytes(b"PAR1 not really a parquet file")
    capfd.readouterr()
    with pytest.raises(ValueError, match=rf"cannot read {tmp_path / 'torn.parquet'} as parquet records: .*parquet"):
        bundle_for(tmp_path, {"name": "files", "paths": [str(tmp_path / "torn.parquet")], "text_field": "body"})
    said = capfd.readouterr()
    assert "Failed to read" not in said.err + said.out, said


@pytest.mark.parametrize("download", ["full", "lazy"])
def test_hf_path_on_local_files_matches_files_source(tmp_path, corpus, download):
    hf = bundle_for(tmp_path, {"name": "hf", "dataset": "json", "data_files": [str(corpus / "records.jsonl")],
                               "text_field": "body", "download": download, "split": "train"})
    files = bundle_for(tmp_path, {"name": "files", "paths": [str(corpus / "records.jsonl")], "text_field": "body"})
    assert documents(hf) == documents(files)
    capped = bundle_for(tmp_path, {"name": "hf", "dataset": "parquet", "data_files": str(corpus / "rows.parquet"),
                                   "text_field": "body", "download": download, "max_docs": 3})
    assert documents(capped) == [f"parquet row {i}. " * 30 for i in range(3)]


def test_passkey_documents_hold_the_key_at_the_chosen_depth(tmp_path):
    b = bundle_for(tmp_path, {"name": "passkey", "num_docs": 6, "length": 600, "depths": [0.0, 1.0], "key_digits": 5, "seed": 0})
    for i, doc in enumerate(documents(b)):
        key = doc.rsplit("The secret key is ", 1)[1].rstrip(".")
        assert len(key) == 5 and doc.count(key) == 3                     # stated twice, answered once
        where = doc.index(key) / len(doc)
        assert where < 0.1 if i % 2 == 0 else where > 0.8
        assert abs(len(doc.encode()) - 600) < 100                       # bytes tokenizer: length in bytes
    prompt, answer = passkey_prompt(2000, 0.5, "12345", lambda s: len(s))
    assert prompt.endswith("The secret key is") and answer == " 12345" and abs(len(prompt) - 2000) < 100


def test_passkey_prompts_are_sized_by_filler_counted_within_a_run():
    """A tokenizer that merges across filler sentences (here: words split on spaces, the trailing
    space of a sentence alone one more 'token') gets prompts of the asked length, and the source's
    fingerprint says its texts differ from those sized a sentence alone; bytes keep both."""
    from types import SimpleNamespace

    from data.sources.passkey import PasskeySource
    from data.tokenizer import ByteTokenizer

    words = SimpleNamespace(encode=lambda text: text.split(" "))
    prompt, answer = passkey_prompt(5000, 0.3, "12345", lambda s: len(words.encode(s)))
    assert abs(len(words.encode(prompt)) - 5000) <= 10
    source = PasskeySource(4, 600, None, 5, 0)
    assert source.for_tokenizer(ByteTokenizer()).fingerprint == source.fingerprint
    assert source.for_tokenizer(words).fingerprint == source.fingerprint + "-runs"


def test_a_passkey_length_below_the_shortest_prompt_gives_bare_documents():
    """The dense curriculum's first stage asks for length=32 to mean filler-free documents, key sentence
    and question alone (docs/long-context.md): any length below the shortest prompt gives just those."""
    from data.passkey import FILLER
    from data.sources.passkey import PasskeySource
    from data.tokenizer import ByteTokenizer

    source = PasskeySource(4, 5, [0.0, 1.0], 5, 0).for_tokenizer(ByteTokenizer())
    for _, doc in source.documents():
        assert FILLER.strip() not in doc and doc.startswith("Remember this: the secret key is")


def test_stdlib_min_doc_bytes_keeps_the_longest_documents():
    from data.sources.stdlib import StdlibSource

    whole, longest = StdlibSource(include_tests=False), StdlibSource(include_tests=False, min_doc_bytes=100_000)
    assert 0 < longest.num_documents < whole.num_documents
    assert all(d.size >= 100_000 for d in longest._docs) and longest.fingerprint != whole.fingerprint
    with pytest.raises(ValueError, match=r"data.min_doc_bytes=1000000000: no document .* is that long \(the longest has"):
        StdlibSource(include_tests=False, min_doc_bytes=10**9)


MIX = {"name": "stdlib-passkey", "min_doc_bytes": 100_000, "max_bytes": 2_000_000, "val_fraction": 0.2,
       "passkey": {"num_docs": 6, "length": 600, "depths": None, "key_digits": 5, "seed": 0}}
OTHER_PASSKEYS = {"passkey": {"num_docs": 4, "length": 300, "depths": None, "key_digits": 5, "seed": 0}}


def test_stdlib_passkey_holds_out_corpus_documents_only(tmp_path):
    """The mix's validation is the corpus's own (the same held-out tokens as the corpus alone), and
    every passkey document is in training."""
    mix = bundle_for(tmp_path, MIX, seq_len=512)
    corpus = bundle_for(tmp_path, {k: v for k, v in MIX.items() if k != "passkey"} | {"name": "stdlib"}, seq_len=512)
    assert mix.val_split == "documents" and mix.validation_digest() == corpus.validation_digest()
    held_out = mix.tokenizer.decode(mix.validation.stream.read(0, mix.val_tokens).tolist())
    assert "secret key" not in held_out
    passkeys = [d for d in documents(mix) if d.startswith(("The river", "Remember"))]
    assert len(passkeys) == 6 and mix.train_tokens == mix.cache.n_tokens - mix.val_tokens
    other = bundle_for(tmp_path, MIX | OTHER_PASSKEYS, seq_len=512)
    assert other.fingerprint != mix.fingerprint and other.validation_digest() == mix.validation_digest()


def test_stdlib_passkey_trains_its_bpe_on_the_corpus_alone(tmp_path):
    bpe = {"name": "bpe", "vocab_size": 300, "min_frequency": 2, "train_max_bytes": 300_000}
    one = bundle_for(tmp_path, MIX, seq_len=512, tokenizer=bpe)
    two = bundle_for(tmp_path, MIX | OTHER_PASSKEYS, seq_len=512, tokenizer=bpe)
    assert one.tokenizer.path == two.tokenizer.path and "-stdlib-" in one.tokenizer.path.parent.name


def test_stdlib_passkey_with_too_few_corpus_documents_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"data.val_fraction=0.2: the corpus's 1 document\(s\) cannot be split"):
        bundle_for(tmp_path, MIX | {"max_bytes": 1})


def test_cache_is_reused_and_keyed_by_content(tmp_path, corpus):
    data = {"name": "files", "paths": [str(corpus / "txt")]}
    first = bundle_for(tmp_path, data)
    manifest = first.cache.path / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    again = bundle_for(tmp_path, data)
    assert again.cache.path == first.cache.path and manifest.stat().st_mtime_ns == stamp
    (corpus / "txt" / "doc0.txt").write_text("changed " * 50)
    changed = bundle_for(tmp_path, data)
    assert changed.fingerprint != first.fingerprint and changed.cache.path != first.cache.path


def test_split_is_by_document_and_independent_of_tokenizer(tmp_path, corpus):
    data = {"name": "files", "paths": [str(corpus / "txt")], "text_extensions": [".txt", ".md"], "val_fraction": 0.3}
    by_bytes = bundle_for(tmp_path, data)
    by_bpe = bundle_for(tmp_path, data, tokenizer={"name": "bpe", "vocab_size": 300, "min_frequency": 2, "train_max_bytes": None})
    val = lambda b: sorted(b.tokenizer.decode(b.validation.stream.read(0, b.val_tokens).tolist()).split("<|endoftext|>"))
    assert val(by_bytes) == val(by_bpe) and len(val(by_bytes)) >= 2


@pytest.mark.parametrize("data, message", [
    ({"name": "files", "paths": ["/nonexistent/corpus"]}, "does not exist"),
    ({"name": "files", "paths": []}, "needs data.paths"),
    ({"name": "files", "paths": ["{corpus}/rows.parquet"]}, r"text field 'text' not in .*columns are \['body', 'n'\]"),
    ({"name": "hf", "dataset": "json", "data_files": ["{corpus}/records.jsonl"], "text_field": "txt", "download": "lazy"},
     r"text field 'txt' not in .*columns are \['body', 'id'\]"),
    ({"name": "hf", "dataset": "json", "data_files": ["{corpus}/missing.jsonl"]}, "does not exist"),
    ({"name": "hf", "dataset": "json", "data_files": ["{corpus}/empty.jsonl"]}, "empty"),
    ({"name": "files", "paths": ["{corpus}/blank"]}, "no documents"),
    ({"name": "hf", "dataset": "json", "data_files": ["{corpus}/records.jsonl"], "download": "stream"},
     r"data.download='stream': expected one of full, lazy"),
    ({"name": "nosuch"}, "data.name='nosuch': expected one of stdlib, files, hf, passkey"),
])
def test_bad_input_is_one_clear_error(tmp_path, corpus, data, message):
    (corpus / "empty.jsonl").write_text("")
    (corpus / "blank").mkdir()
    (corpus / "blank" / "a.txt").write_text("")
    data = {k: ([p.format(corpus=corpus) for p in v] if isinstance(v, list) else v) for k, v in data.items()}
    with pytest.raises(ValueError, match=message) as e:
        bundle_for(tmp_path, data)
    assert "\n" not in str(e.value)


def test_seq_len_checks_name_the_fix(tmp_path, corpus):
    data = {"name": "files", "paths": [str(corpus / "txt")]}
    with pytest.raises(ValueError, match="longer than the whole train split"):
        bundle_for(tmp_path, data, seq_len=100_000)
    with pytest.raises(ValueError, match="raise data.val_fraction"):
        bundle_for(tmp_path, {**data, "val_fraction": 0.05}, seq_len=1000)
    no_val = bundle_for(tmp_path, {**data, "val_fraction": 0.0})
    with pytest.raises(ValueError, match="val_fraction is 0"):
        no_val.val_batches(1, 1)
    assert np.isclose(no_val.train_tokens, no_val.cache.n_tokens)
