"""Token cache: a corpus tokenized once into a memory-mapped file, reused by every later run.

Layout of one cache folder (keyed by source fingerprint, tokenizer fingerprint, CACHE_VERSION):

    tokens.bin     every document's ids followed by the end-of-document id (uint16/uint32)
    offsets.npy    int64, n_docs + 1: document i is tokens[offsets[i]:offsets[i+1]] (EOT included)
    keys.npy       uint64 hash of each document's name (chooses the validation split)
    manifest.json  sizes and sha256 of the three files above; written last

The folder is built under a temporary name and renamed into place, so a crash never leaves
a half-written cache under the real name; a cache cut short or altered afterwards fails the
manifest check and is rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from data.digest import file_sha256, name_key
from data.tokenizer import token_dtype

log = logging.getLogger(__name__)
CACHE_VERSION = 1
FILES = ("tokens.bin", "offsets.npy", "keys.npy")
BATCH_CHARS = 4_000_000   # text handed to the tokenizer per call (parallel inside the call)


class InvalidCache(Exception):
    """The cache folder is incomplete or does not match its manifest."""


@dataclass
class TokenCache:
    path: Path
    tokens: np.ndarray      # memory-mapped, read-only
    offsets: np.ndarray
    keys: np.ndarray
    manifest: dict          # what built it: source/tokenizer fingerprints, counts, checksums

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])


def cache_key(source_fp: str, tokenizer_fp: str) -> str:
    return hashlib.sha256(f"{source_fp}|{tokenizer_fp}|v{CACHE_VERSION}".encode()).hexdigest()[:16]


def load_or_build(root: Path, source, tokenizer, verify: bool = True, progress: bool = True) -> TokenCache:
    """The cache for (source, tokenizer) under `root`, built first if missing or invalid."""
    path = Path(root).expanduser() / "tokens" / f"{source.name}-{tokenizer.name}-{cache_key(source.fingerprint, tokenizer.fingerprint)}"
    if path.exists():
        try:
            return load(path, verify)
        except InvalidCache as e:
            warnings.warn(f"token cache {path} is invalid ({e}); rebuilding it")
    remove_stale_builds(path.parent)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp, source, tokenizer, progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():  # a concurrent builder (another rank) may have put a valid one there meanwhile
        try:
            load(path, verify)
        except InvalidCache:  # the invalid one seen above: moved aside in one rename, then deleted
            stale = path.with_name(f"{path.name}.stale-{os.getpid()}")
            try:
                os.replace(path, stale)
            except FileNotFoundError:  # another builder moved it first
                pass
            shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, path)
    except OSError:
        # Another process (rank) renamed its identical build into place first: never delete it.
        shutil.rmtree(tmp, ignore_errors=True)
    return load(path, verify)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def remove_stale_builds(tokens_dir: Path) -> None:
    """Delete `<cache>.tmp-<pid>` folders whose builder is gone (killed mid-tokenization)."""
    if not tokens_dir.is_dir():
        return
    for tmp in tokens_dir.glob("*.tmp-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            warnings.warn(f"removing {tmp}, left by a tokenization that was killed (pid {pid})")
            shutil.rmtree(tmp, ignore_errors=True)


def build(path: Path, source, tokenizer, progress: bool = True) -> None:
    """Tokenize every document of `source` into a new cache folder at `path`. The progress bar is
    drawn only on a terminal (a log file would get every frame); a line says what was built."""
    path.mkdir(parents=True)
    dtype = token_dtype(tokenizer.vocab_size)
    eot = np.array([tokenizer.eot_id], dtype=dtype)
    offsets, keys, n_bytes = [0], [], 0
    began = time.perf_counter()
    bar = tqdm(total=source.num_documents, unit="doc", desc=f"tokenizing {source.name}",
               disable=not (progress and sys.stderr.isatty()))

    def flush(batch: list[tuple[str, str]], out) -> None:
        nonlocal n_bytes
        n_bytes += sum(len(text.encode("utf-8")) for _, text in batch)
        for (name, _), ids in zip(batch, tokenizer.encode_arrays([t for _, t in batch])):
            out.write(ids.astype(dtype, copy=False).tobytes())
            out.write(eot.tobytes())
            offsets.append(offsets[-1] + len(ids) + 1)
            keys.append(name_key(name))
        bar.update(len(batch))
        bar.set_postfix(tokens=f"{offsets[-1]:,}")

    with bar, open(path / "tokens.bin", "wb") as out:  # the bar closes before an error is printed
        batch, chars = [], 0
        for name, text in source.documents():
            if not text:
                continue
            batch.append((name, text))
            chars += len(text)
            if chars >= BATCH_CHARS:
                flush(batch, out)
                batch, chars = [], 0
        if batch:
            flush(batch, out)
    if len(keys) == 0:
        raise ValueError(f"{getattr(source, 'origin', None) or 'data source ' + source.fingerprint} yielded no "
                         f"documents: every one is empty")
    np.save(path / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    np.save(path / "keys.npy", np.asarray(keys, dtype=np.uint64))
    manifest = {
        "version": CACHE_VERSION,
        "source": source.fingerprint,
        "tokenizer": tokenizer.fingerprint,
        "dtype": dtype.name,
        "n_docs": len(keys),
        "n_tokens": offsets[-1],
        "n_bytes": n_bytes,          # UTF-8 text that went in (bytes per token = compression)
        "files": {f: {"size": (path / f).stat().st_size, "sha256": file_sha256(path / f)} for f in FILES},
    }
    tmp = path / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path / "manifest.json")
    if progress:
        log.info("tokenized %s: %s documents, %s tokens in %.1f s (%s)", source.name, f"{len(keys):,}",
                 f"{offsets[-1]:,}", time.perf_counter() - began, tokenizer.name)


def load(path: Path, verify: bool = True) -> TokenCache:
    """Open a cache folder; raises InvalidCache when it is incomplete, altered, or its manifest is
    not the object `build` writes (a hand-edited or foreign manifest.json is rebuilt, not trusted)."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidCache(f"unreadable manifest.json: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("version") != CACHE_VERSION:
        raise InvalidCache(f"manifest.json is not a version {CACHE_VERSION} manifest")
    try:
        return _open(path, manifest, verify)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError, OSError, EOFError) as e:
        raise InvalidCache(f"manifest.json or the files it lists are malformed ({type(e).__name__}: {e})") from None


def _open(path: Path, manifest: dict, verify: bool) -> TokenCache:
    if set(manifest["files"]) != set(FILES):
        raise InvalidCache(f"manifest.json lists {sorted(manifest['files'])}, not {list(FILES)}")
    for f, expect in manifest["files"].items():
        p = path / f
        if not p.is_file() or p.stat().st_size != expect["size"]:
            raise InvalidCache(f"{f} is missing or has the wrong size")
        if verify and file_sha256(p) != expect["sha256"]:
            raise InvalidCache(f"{f} does not match its checksum")
    offsets = np.load(path / "offsets.npy")
    keys = np.load(path / "keys.npy")
    dtype = np.dtype(manifest["dtype"])
    n_tokens = int(manifest["n_tokens"])
    if offsets[-1] != n_tokens or len(keys) != manifest["n_docs"] or n_tokens * dtype.itemsize != manifest["files"]["tokens.bin"]["size"]:
        raise InvalidCache("offsets, keys and tokens.bin disagree")
    tokens = np.memmap(path / "tokens.bin", dtype=dtype, mode="r", shape=(n_tokens,))
    return TokenCache(path, tokens, offsets, keys, manifest)
