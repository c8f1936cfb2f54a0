"""build_data: the default corpus, the token cache, the sampler's determinism, resume and sharding."""
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from training.builders import build_data
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


@pytest.mark.parametrize("windows", ["moving", "fixed"])
def test_rank_shards_are_disjoint_and_cover_the_epoch(tmp_path, windows):
    cfg = make_cfg(tmp_path, {"windows": windows})
    samplers = [build_data(cfg, seq_len=64, seed=1, rank=r, world_size=3, progress=False).train for r in range(3)]
    for epoch in (0, 1):
        shards = [s.shard(epoch) for s in samplers]
        everything = np.concatenate(shards)
        n = len(samplers[0].order(epoch))   # this epoch's windows (the fixed cut: always n_windows)
        # Ranks move in lockstep: an epoch drops its last n % 3 windows (fewer than the ranks).
        assert len(everything) == len(set(everything.tolist())) == n - n % 3
        assert set(everything.tolist()) == set(samplers[0].order(epoch)[: n - n % 3].tolist())
        # Every other window of the stream is read exactly once per epoch.
        seen = sum(s.window(int(i), epoch)[1:].size for s, shard in zip(samplers, shards) for i in shard)
        assert seen == (n - n % 3) * 64


def targets_per_token(sampler, epoch: int) -> np.ndarray:
    """How often each stream position is a target (a y token) in `epoch`, from the windows drawn."""
    count = np.zeros(sampler.stream.n_tokens, dtype=np.int64)
    for i in sampler.order(epoch):
        start = sampler.offset(epoch) + int(i) * sampler.seq_len
        count[start + 1 : start + 1 + sampler.seq_len] += 1
    return count


def test_moving_windows_start_elsewhere_each_epoch_and_cover_every_token_once(tmp_path):
    sampler = build_data(make_cfg(tmp_path), seq_len=128, seed=2, progress=False).train
    assert sampler.windows == "moving"   # the default
    offsets = [sampler.offset(e) for e in range(8)]
    assert all(0 <= o < 128 for o in offsets) and len(set(offsets)) >= 6, offsets
    n = sampler.stream.n_tokens
    for epoch in range(3):
        count = targets_per_token(sampler, epoch)
        assert count.max() == 1                    # no token is a target twice in an epoch
        assert n - count.sum() < 2 * 128           # and all but the two ends' few are targets once
    # Drawing batch after batch reads exactly those windows: the first epoch's in its order,
    # then the second epoch's at its own offset.
    per_epoch = len(sampler.order(0))
    x, _ = sampler.next_batch(per_epoch + 3)
    read = lambda e, i: torch.from_numpy(sampler.window(int(i), e)[:-1].astype(np.int64))  # noqa: E731
    assert all(torch.equal(x[j], read(0, sampler.order(0)[j])) for j in range(per_epoch))
    assert all(torch.equal(x[per_epoch + j], read(1, sampler.order(1)[j])) for j in range(3))
    assert sampler.epoch == 1
    # Deterministic from the seed; another seed moves the windows elsewhere.
    again = build_data(make_cfg(tmp_path), seq_len=128, seed=2, progress=False).train
    assert [again.offset(e) for e in range(8)] == offsets
    other = build_data(make_cfg(tmp_path), seq_len=128, seed=3, progress=False).train
    assert [other.offset(e) for e in range(8)] != offsets


def test_fixed_windows_are_the_offset_zero_cut_of_earlier_runs(tmp_path):
    """data.windows=fixed repeats the sampler of runs before moving windows, batch for batch."""
    sampler = build_data(make_cfg(tmp_path, {"windows": "fixed"}), seq_len=128, seed=2, progress=False).train
    assert [sampler.offset(e) for e in range(4)] == [0, 0, 0, 0]
    for epoch in range(2):
        assert np.array_equal(sampler.order(epoch), np.random.default_rng([2, epoch]).permutation(sampler.n_windows))
    x, _ = sampler.next_batch(2)
    first = int(np.random.default_rng([2, 0]).permutation(sampler.n_windows)[0])
    assert torch.equal(x[0], torch.from_numpy(sampler.stream.read(first * 128, 128).astype(np.int64)))


def test_sampler_state_of_another_cut_is_refused_in_one_line(tmp_path):
    moving = build_data(make_cfg(tmp_path), seq_len=64, seed=1, progress=False).train
    fixed = build_data(make_cfg(tmp_path, {"windows": "fixed"}), seq_len=64, seed=1, progress=False).train
    old = {k: v for k, v in fixed.state_dict().items() if k != "windows"}   # a checkpoint from before the option
    with pytest.raises(ValueError, match=r"written before moving windows existed.*pass data.windows=fixed"):
        moving.load_state_dict(old)
    fixed.load_state_dict(old)   # resumes in the cut it was written in
    with pytest.raises(ValueError, match=r"its run had data.windows=moving.*pass data.windows=moving"):
        fixed.load_state_dict(moving.state_dict())


def drawn(samplers, steps: int, batch: int) -> list[list[int]]:
    """Window indices each rank draws in `steps` batches (all within epoch 0), found by their tokens."""
    s0 = samplers[0]
    n = len(s0.order(0))
    index = {tuple(s0.window(i, 0)[:-1].tolist()): i for i in range(n)}
    assert len(index) == n  # no two windows alike: tokens identify a window
    out = [[] for _ in samplers]
    for _ in range(steps):
        for r, s in enumerate(samplers):
            x, _ = s.next_batch(batch)
            out[r] += [index[tuple(row.tolist())] for row in x]
    return out


@pytest.mark.parametrize("windows", ["moving", "fixed"])
@pytest.mark.parametrize("worlds", [(2, 3), (3, 1), (1, 2), (1, 2, 1)], ids=lambda w: "->".join(map(str, w)))
def test_resume_on_another_number_of_ranks_neither_repeats_nor_skips(tmp_path, worlds, windows):
    cfg = make_cfg(tmp_path, {"windows": windows})
    bundle = lambda r, w: build_data(cfg, seq_len=512, seed=5, rank=r, world_size=w, progress=False).train  # noqa: E731
    state, consumed, order = None, [], None
    for world, (steps, batch) in zip(worlds, [(7, 3), (5, 2), (4, 2)]):
        ranks = [bundle(r, world) for r in range(world)]
        order = ranks[0].order(0) if order is None else order
        for s in ranks:
            if state is not None:
                s.load_state_dict(state)
        later = [w for rank in drawn(ranks, steps, batch) for w in rank]
        state = ranks[0].state_dict()
        assert all(s.state_dict() == state for s in ranks)  # one global position, whichever rank saves it
        assert len(set(later)) == len(later) and not set(later) & set(consumed)  # disjoint ranks, no repeat
        consumed += later
        # together: exactly the next entries of the epoch's order, nothing skipped
        assert sorted(consumed) == sorted(order[: len(consumed)].tolist())


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


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "manifest_list", "manifest_without_files",
                                    "manifest_files_a_list"])
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
    elif damage == "no_manifest":
        (shard.parent / "manifest.json").unlink()
    else:   # valid JSON of the wrong shape: it used to crash every later run the same way
        manifest = json.loads((shard.parent / "manifest.json").read_text())
        wrong = {"manifest_list": [manifest], "manifest_without_files": {"version": manifest["version"]},
                 "manifest_files_a_list": {**manifest, "files": list(manifest["files"])}}[damage]
        (shard.parent / "manifest.json").write_text(json.dumps(wrong))
    with pytest.warns(UserWarning, match="invalid"):
        rebuilt = load_or_build(tmp_path, source, tok, progress=False)
    np.testing.assert_array_equal(np.array(rebuilt.tokens), good)

