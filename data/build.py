"""`build_data`: config -> tokenizer + token cache + train sampler + validation batches."""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.cache import CACHE_VERSION, TokenCache, load_or_build
from data.sampler import ValidationWindows, WindowSampler
from data.sources import build_source, tokenizer_corpus, train_only_keys
from data.stream import TokenStream, split_corpus
from data.tokenizer import build_tokenizer

log = logging.getLogger(__name__)


@dataclass
class DataBundle:
    tokenizer: object
    vocab_size: int
    fingerprint: str          # "<source>/<tokenizer>/v<cache version>": what the run trained on
    train: WindowSampler
    validation: ValidationWindows | None
    cache: TokenCache
    train_tokens: int
    val_tokens: int
    val_split: str = "documents"   # what is held out: whole "documents", or the corpus's last "tokens"

    def val_batches(self, batch_size: int, n_batches: int, return_doc_ids: bool = False) -> list:
        """The same list of (x, y) on every call: windows from the held-out documents."""
        if self.validation is None:
            raise ValueError("no validation split: data.val_fraction is 0")
        return self.validation.batches(batch_size, n_batches, return_doc_ids)

    def validation_digest(self) -> str:
        """A short sha256 of the held-out token ids and the tokenizer: equal for two runs exactly
        when they would be evaluated on the same held-out tokens (another corpus, split or tokenizer
        changes it; a mix's synthetic documents, never held out, do not)."""
        if self.validation is None:
            raise ValueError("no validation split: data.val_fraction is 0")
        stream = self.validation.stream
        h = hashlib.sha256(self.tokenizer.fingerprint.encode())
        h.update(np.ascontiguousarray(stream.read(0, stream.n_tokens)).tobytes())
        return h.hexdigest()[:16]


def build_data(cfg, data: dict, cache_dir: Path, seq_len: int, seed: int, rank: int = 0, world_size: int = 1,
               progress: bool | None = None, seq_len_from: str = "trainer.seq_len",
               check_tokenizer: Callable[[str], None] | None = None) -> DataBundle:
    """Everything the loop needs from `cfg.data` and `cfg.tokenizer`; tokenizes on first use.

    `data` is the `cfg.data` group already checked against the config's schema, its defaults
    filled in, and `cache_dir` a folder known to be writable: training.builders.build_data, which
    every caller uses, does both before this is called. check_tokenizer(fingerprint) runs once the
    tokenizer is known and before the corpus is tokenized with it: a resume refuses another
    tokenizer there, before the longest part of the work."""
    progress = rank == 0 if progress is None else progress
    source = build_source(cfg.data, cache_dir)
    tokenizer = build_tokenizer(cfg.tokenizer, tokenizer_corpus(source), cache_dir, progress)
    if check_tokenizer is not None:
        check_tokenizer(tokenizer.fingerprint)
    source = source.for_tokenizer(tokenizer)
    cache = load_or_build(cache_dir, source, tokenizer, verify=data["verify_cache"], progress=progress)

    val_fraction = data["val_fraction"]
    keep = train_only_keys(source)
    train_only = None if keep is None else np.isin(cache.keys, keep)
    offsets, is_val, val_split = split_corpus(cache.offsets, cache.keys, val_fraction, train_only)
    if val_split == "tokens" and rank == 0:
        log.info("%s has %d document(s), too few to hold out whole ones for data.val_fraction=%g: validation is "
                 "the last %d of its %d tokens", source.fingerprint, cache.n_docs, val_fraction,
                 int(offsets[-1] - offsets[:-1][is_val][0]), cache.n_tokens)
    train = TokenStream(cache.tokens, offsets, ~is_val)
    if train.n_tokens < seq_len + 1:
        raise ValueError(
            f"seq_len={seq_len} is longer than the whole train split ({train.n_tokens:,} tokens in "
            f"{train.n_docs} documents of {source.fingerprint}); lower {seq_len_from} or use a larger corpus"
        )
    validation = None
    if is_val.any():
        val = TokenStream(cache.tokens, offsets, is_val)
        if val.n_tokens < seq_len + 1:
            raise ValueError(
                f"the validation split has {val.n_tokens:,} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                f"raise data.val_fraction (now {val_fraction}) or lower {seq_len_from}"
            )
        validation = ValidationWindows(val, seq_len, tokenizer.eot_id)
    return DataBundle(
        tokenizer=tokenizer,
        vocab_size=tokenizer.vocab_size,
        fingerprint=f"{source.fingerprint}/{tokenizer.fingerprint}/v{CACHE_VERSION}",
        train=WindowSampler(train, seq_len, seed, tokenizer.eot_id, rank, world_size, data["windows"]),
        validation=validation,
        cache=cache,
        train_tokens=train.n_tokens,
        val_tokens=validation.stream.n_tokens if validation else 0,
        val_split=val_split,
    )
