"""Content hashes the caches are keyed and checked by."""
from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def files_content_sha256(paths, names=None) -> str:
    """One hash of several files' names and bytes: the corpus fingerprint that edits change and
    `touch`, `cp -p` or `rsync -a` of unchanged bytes do not (sha256 reads ~0.7 GB/s a core)."""
    h = hashlib.sha256()
    for name, path in zip(names or [str(p) for p in paths], paths):
        h.update(f"{name}\t{file_sha256(Path(path))}\n".encode())
    return h.hexdigest()


def name_key(name: str) -> int:
    """Stable 64-bit hash of a document name (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
