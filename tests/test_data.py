"""build_data: the default corpus, the token cache, the sampler's determinism, resume and sharding."""
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from data import build_data
from data.cache import load_or_build
from data.sources.stdlib import StdlibSource
from data.tokenizer import ByteTokenizer

STDLIB_CAP = 300_000   # bytes of the standard library: a few dozen documents, builds in well under 1 s


def make_cfg(tmp_path, data: dict | None = None, tokenizer: dict | None = None):
    base = {"name": "stdlib", "max_bytes": STDLIB_CAP, "include_tests": False, "val_fraction": 0.1}
    return OmegaConf.create({
        "data": {**base, "cache_dir": str(tmp_path / "cache"), "verify_cache": True, **(data or {})},
        "tokenizer": tokenizer or {"name": "bytes"},
    })


def test_stdlib_default_bundle(tmp_path):
    bundle = build_data(make_cfg(tmp_path), seq_len=64, seed=0, progress=False)
    assert bundle.vocab_size == 257 and bundle.tokenizer.eot_id == 256
    assert bundle.fingerprint.startswith("stdlib-py") and bundle.fingerprint.endswith("/bytes/v1")
    x, y = bundle.train.next_batch(4)
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    assert 0 < bundle.val_tokens <= 0.1 * bundle.cache.n_tokens   # val_fraction is a token budget
    # Real Python source decodes back to text.
    assert "def " in bundle.tokenizer.decode(bundle.cache.tokens[: bundle.cache.n_tokens].tolist())


def test_stdlib_documents_are_modules_of_10k_to_1m_bytes():
    src = StdlibSource(max_bytes=2_000_000, include_tests=False)
    names = [name for name, _ in src.documents()]
    assert names and all(10_000 <= d.size <= 1_000_000 for d in src._docs)
    assert not any("site-packages" in str(f) for d in src._docs for f in d.files)
    assert src.fingerprint != StdlibSource(max_bytes=1_000_000, include_tests=False).fingerprint


def test_val_batches_identical_and_held_out_by_document(tmp_path):
    bundle = build_data(make_cfg(tmp_path), seq_len=32, seed=0, progress=False)
    a, b = bundle.val_batches(2, 3), bundle.val_batches(2, 3)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    train_docs = bundle.train.stream.n_docs
    val_docs = bundle.validation.stream.n_docs
    assert train_docs + val_docs == bundle.cache.n_docs and val_docs >= 1
    assert bundle.train_tokens + bundle.val_tokens == bundle.cache.n_tokens


def test_resume_replays_the_same_batches(tmp_path):
    cfg = make_cfg(tmp_path)
    run = build_data(cfg, seq_len=128, seed=3, progress=False).train
    n_epoch = len(run.shard(0))
    [run.next_batch(5) for _ in range(n_epoch // 5 - 1)]   # stop just before an epoch boundary
    state = run.state_dict()
    expected = [run.next_batch(5) for _ in range(4)]      # crosses into epoch 1
    assert run.epoch == 1

    resumed = build_data(cfg, seq_len=128, seed=3, progress=False).train
    resumed.load_state_dict(state)
    for (xe, ye), (xr, yr) in zip(expected, [resumed.next_batch(5) for _ in range(4)]):
        assert torch.equal(xe, xr) and torch.equal(ye, yr)
    other_seed = build_data(cfg, seq_len=128, seed=4, progress=False).train
    assert not torch.equal(other_seed.next_batch(5)[0], build_data(cfg, seq_len=128, seed=3, progress=False).train.next_batch(5)[0])
    with pytest.raises(ValueError, match="seq_len"):
        build_data(cfg, seq_len=64, seed=3, progress=False).train.load_state_dict(state)


def test_rank_shards_are_disjoint_and_cover_the_epoch(tmp_path):
    cfg = make_cfg(tmp_path)
    samplers = [build_data(cfg, seq_len=64, seed=1, rank=r, world_size=3, progress=False).train for r in range(3)]
    shards = [s.shard(0) for s in samplers]
    everything = np.concatenate(shards)
    n = samplers[0].n_windows
    # Ranks move in lockstep: an epoch drops its last n % 3 windows (fewer than the ranks).
    assert len(everything) == len(set(everything.tolist())) == n - n % 3
    assert set(everything.tolist()) == set(samplers[0].order(0)[: n - n % 3].tolist())
    # Every other window of the stream is read exactly once per epoch.
    seen = sum(s.window(int(i))[1:].size for s, shard in zip(samplers, shards) for i in shard)
    assert seen == (n - n % 3) * 64


def drawn(samplers, steps: int, batch: int) -> list[list[int]]:
    """Window indices each rank draws in `steps` batches, found by their tokens."""
    s0 = samplers[0]
    index = {tuple(s0.window(i)[:-1].tolist()): i for i in range(s0.n_windows)}
    assert len(index) == s0.n_windows  # no two windows alike: tokens identify a window
    out = [[] for _ in samplers]
    for _ in range(steps):
        for r, s in enumerate(samplers):
            x, _ = s.next_batch(batch)
            out[r] += [index[tuple(row.tolist())] for row in x]
    return out


@pytest.mark.parametrize("before,after", [(2, 3), (3, 1), (1, 2)])
def test_resume_on_another_number_of_ranks_neither_repeats_nor_skips(tmp_path, before, after):
    cfg = make_cfg(tmp_path)
    bundle = lambda r, w: build_data(cfg, seq_len=512, seed=5, rank=r, world_size=w, progress=False).train  # noqa: E731
    first = [bundle(r, before) for r in range(before)]
    seen = drawn(first, steps=7, batch=3)
    state = first[0].state_dict()
    assert all(s.state_dict() == state for s in first)  # one global position, whichever rank saves it
    second = [bundle(r, after) for r in range(after)]
    for s in second:
        s.load_state_dict(state)
    later = drawn(second, steps=5, batch=2)
    consumed = [w for rank in seen for w in rank]
    resumed = [w for rank in later for w in rank]
    assert len(set(resumed)) == len(resumed) and not set(resumed) & set(consumed)  # disjoint ranks, no repeat
    # together: exactly the next entries of the epoch's order, nothing skipped
    order = first[0].order(0)
    assert sorted(consumed + resumed) == sorted(order[: len(consumed) + len(resumed)].tolist())


def test_doc_ids_mark_document_boundaries(tmp_path):
    bundle = build_data(make_cfg(tmp_path), seq_len=512, seed=0, progress=False)
    eot = bundle.tokenizer.eot_id
    for _ in range(50):
        x, _, doc = bundle.train.next_batch(4, return_doc_ids=True)
        if (x == eot).any():
            break
    row = int((x == eot).any(dim=1).nonzero()[0])
    t = int((x[row] == eot).nonzero()[0])
    assert doc[row, t] == doc[row, 0] == 0 and (t + 1 == x.shape[1] or doc[row, t + 1] == 1)


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest"])
def test_damaged_cache_is_detected_and_rebuilt(tmp_path, damage):
    source, tok = StdlibSource(max_bytes=100_000, include_tests=False), ByteTokenizer()
    cache = load_or_build(tmp_path, source, tok, progress=False)
    good = np.array(cache.tokens)
    shard = cache.path / "tokens.bin"
    del cache
    if damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    elif damage == "flip":
        with open(shard, "r+b") as f:
            f.seek(10)
            byte = f.read(1)
            f.seek(10)
            f.write(bytes([byte[0] ^ 1]))
    else:
        (shard.parent / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="invalid"):
        rebuilt = load_or_build(tmp_path, source, tok, progress=False)
    np.testing.assert_array_equal(np.array(rebuilt.tokens), good)

