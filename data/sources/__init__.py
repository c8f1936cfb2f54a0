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


def build_source(cfg, cache_dir: Path) -> Source:
    """The document source named by `cfg.name` (the `data` config group)."""
    name = cfg.name
    if name == "stdlib":
        from data.sources.stdlib import StdlibSource

        return StdlibSource(max_bytes=cfg.get("max_bytes"), include_tests=bool(cfg.get("include_tests", True)))
    if name == "files":
        from data.sources.files import FilesSource

        return FilesSource(cfg, cache_dir)
    if name == "hf":
        from data.sources.hf import HFSource

        return HFSource(cfg, cache_dir)
    if name == "passkey":
        from data.sources.passkey import PasskeySource

        return PasskeySource.from_config(cfg)
    raise ValueError(f"unknown data.name {name!r} (expected stdlib, files, hf or passkey)")
