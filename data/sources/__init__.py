"""Document sources: each yields (name, text) pairs and a fingerprint of what it reads.

The name identifies a document stably (module, file, record index); the validation split is
chosen by hashing names, so it does not move when the tokenizer changes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol


class Source(Protocol):
    name: str              # short source kind, used in cache folder names
    fingerprint: str       # short string that changes whenever the documents could change
    num_documents: int | None   # for progress bars; None when unknown (streaming)

    def documents(self) -> Iterator[tuple[str, str]]: ...

    def for_tokenizer(self, tokenizer) -> "Source":
        """The source whose documents the cache will hold (passkey sizes its texts in tokens)."""
        ...

    # Optional, only a mix of a corpus and synthetic documents (data/sources/mix.py) has them:
    #   tokenizer_corpus() -> Source: what a BPE trains on and is keyed by (default: the source itself)
    #   train_only_keys() -> array of name keys: documents never held out for validation (default: none)


def tokenizer_corpus(source) -> Source:
    """The source a BPE tokenizer trains on: a mix's corpus, else the source itself."""
    return source.tokenizer_corpus() if hasattr(source, "tokenizer_corpus") else source


def train_only_keys(source):
    """Name keys of the documents a validation split must leave in training (a mix's synthetic
    ones), or None."""
    return source.train_only_keys() if hasattr(source, "train_only_keys") else None


def build_source(cfg, cache_dir: Path) -> Source:
    """The document source named by `cfg.name` (the `data` config group)."""
    name = cfg.name
    if name == "stdlib":
        return _stdlib(cfg)
    if name == "files":
        from data.sources.files import FilesSource

        return FilesSource(cfg, cache_dir)
    if name == "hf":
        from data.sources.hf import HFSource

        return HFSource(cfg, cache_dir)
    if name == "passkey":
        from data.sources.passkey import PasskeySource

        return PasskeySource.from_config(cfg)
    if name == "stdlib-passkey":
        from data.sources.mix import MixSource
        from data.sources.passkey import PasskeySource

        return MixSource(_stdlib(cfg), PasskeySource.from_config(cfg.passkey))
    raise ValueError(f"unknown data.name {name!r} (expected stdlib, files, hf, passkey or stdlib-passkey)")


def _stdlib(cfg):
    from data.sources.stdlib import StdlibSource

    return StdlibSource(max_bytes=cfg.get("max_bytes"), include_tests=bool(cfg.get("include_tests", True)),
                        min_doc_bytes=cfg.get("min_doc_bytes"))
