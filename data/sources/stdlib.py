"""The offline default corpus: the Python standard library's own source code.

It is present wherever Python is, needs no network, was written by many people over
decades, and has long documents: each top-level module or package becomes one document.
Packages larger than MAX_DOC_BYTES are split into their sub-modules/sub-packages, and
consecutive modules smaller than MIN_DOC_BYTES are merged, so documents span ~10K-1M bytes
(bytes tokenizer: tokens). `min_doc_bytes` keeps only the documents of at least that many bytes
(the corpus's longest, for long-context training), before `max_bytes` caps the total.
"""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from data.digest import files_content_sha256

MIN_DOC_BYTES = 10_000
MAX_DOC_BYTES = 1_000_000
# Installed third-party code and build artefacts are not the standard library.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}


@dataclass
class _Unit:
    name: str
    files: list[Path]
    size: int


class StdlibSource:
    name = "stdlib"

    def __init__(self, max_bytes: int | None = None, include_tests: bool = True, root: str | None = None,
                 min_doc_bytes: int | None = None):
        self.root = Path(root or sysconfig.get_paths()["stdlib"])
        if not self.root.is_dir():
            raise ValueError(f"Python standard library folder not found: {self.root}")
        self.include_tests = include_tests
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.min_doc_bytes = None if min_doc_bytes is None else int(min_doc_bytes)
        docs = _merge_small(self._units(self.root))
        if self.min_doc_bytes is not None:
            longest = max((d.size for d in docs), default=0)
            docs = [d for d in docs if d.size >= self.min_doc_bytes]
            if not docs:
                raise ValueError(f"data.min_doc_bytes={self.min_doc_bytes}: no document of the standard library under "
                                 f"{self.root} is that long (the longest has {longest:,} bytes)")
        self._docs = _cap(docs, self.max_bytes)
        if not self._docs:
            raise ValueError(f"no Python source files found under {self.root}")
        self.num_documents = len(self._docs)
        files = [f for doc in self._docs for f in doc.files]
        listing = hashlib.sha256(files_content_sha256(files, [str(f.relative_to(self.root)) for f in files]).encode())
        settings = f"tests={int(include_tests)},cap={self.max_bytes}"
        if self.min_doc_bytes is not None:   # only then: the fingerprints (and caches) of whole corpora stay as they were
            settings += f",min={self.min_doc_bytes}"
        listing.update(settings.encode())
        self.fingerprint = f"stdlib-py{platform.python_version()}-{listing.hexdigest()[:10]}"
        self.total_bytes = sum(d.size for d in self._docs)

    def for_tokenizer(self, tokenizer) -> "StdlibSource":
        return self

    def documents(self) -> Iterator[tuple[str, str]]:
        for doc in self._docs:
            # A few test files are deliberately not UTF-8; replacement keeps them deterministic.
            parts = [f.read_bytes().decode("utf-8", errors="replace") for f in doc.files]
            yield doc.name, "\n\n".join(parts)

    def _keep_dir(self, path: Path) -> bool:
        if path.name in EXCLUDED_DIRS or path.name.startswith("config-"):
            return False
        return self.include_tests or path.name not in TEST_DIRS

    def _py_files(self, folder: Path) -> list[Path]:
        out = []
        for entry in sorted(folder.iterdir()):
            if entry.is_dir() and self._keep_dir(entry):
                out.extend(self._py_files(entry))
            elif entry.suffix == ".py" and entry.is_file():
                out.append(entry)
        return out

    def _units(self, folder: Path) -> list[_Unit]:
        """One unit per module file or package folder; oversized packages split recursively."""
        units = []
        for entry in sorted(folder.iterdir()):
            if entry.is_dir() and self._keep_dir(entry):
                files = self._py_files(entry)
                size = sum(f.stat().st_size for f in files)
                if size > MAX_DOC_BYTES:
                    units.extend(self._units(entry))
                elif files:
                    units.append(_Unit(self._module_name(entry), files, size))
            elif entry.suffix == ".py" and entry.is_file():
                units.append(_Unit(self._module_name(entry), [entry], entry.stat().st_size))
        return units

    def _module_name(self, path: Path) -> str:
        return ".".join(path.relative_to(self.root).with_suffix("").parts)


def _merge_small(units: list[_Unit]) -> list[_Unit]:
    """Merge runs of consecutive units until each reaches MIN_DOC_BYTES (neighbours are related)."""
    merged: list[_Unit] = []
    for u in units:
        last = merged[-1] if merged else None
        if last is not None and last.size < MIN_DOC_BYTES and last.size + u.size <= MAX_DOC_BYTES:
            merged[-1] = _Unit(f"{last.name}+{u.name}", last.files + u.files, last.size + u.size)
        else:
            merged.append(u)
    return merged


def _cap(docs: list[_Unit], max_bytes: int | None) -> list[_Unit]:
    if max_bytes is None:
        return docs
    out, total = [], 0
    for d in docs:
        if total >= max_bytes:
            break
        out.append(d)
        total += d.size
    return out
