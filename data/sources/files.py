"""Local corpora (`data=files data.paths=[dir, file, ...]`).

Plain-text files are one document each; JSON lines and parquet files are one document per
record, read through `datasets.load_dataset("json" | "parquet", data_files=...)`, the call
the Hugging Face path makes.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

from data.sources.audit import BadDocuments
from data.sources.hf import as_list, check_text_field, load_records, local_files_signature, record_texts

RECORD_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class FilesSource:
    name = "files"

    def __init__(self, cfg, cache_dir: Path):
        paths = [Path(str(p)).expanduser() for p in as_list(cfg.get("paths"))]
        if not paths:
            raise ValueError("data=files needs data.paths=[<file or folder>, ...]")
        self.text_field = str(cfg.get("text_field", "text"))
        text_ext = {e if e.startswith(".") else f".{e}" for e in as_list(cfg.get("text_extensions", [".txt"]))}
        self.text_files: list[tuple[str, Path]] = []          # (document name, path)
        records: dict[str, list[Path]] = {}                   # builder -> files
        for root in paths:
            if not root.exists():
                raise ValueError(f"data.paths: {root} does not exist")
            if not root.is_dir() and not root.is_file():  # reading a FIFO blocks, /dev/zero never ends
                raise ValueError(f"data.paths: {root} is not a regular file or a folder (a FIFO, device or socket)")
            found = sorted(p for p in root.rglob("*") if p.is_file() and not _hidden(p.relative_to(root))) if root.is_dir() else [root]
            for p in found:
                name = f"{root.name}/{p.relative_to(root)}" if root.is_dir() else root.name
                if p.suffix in RECORD_FORMATS:
                    records.setdefault(RECORD_FORMATS[p.suffix], []).append(p)
                elif p.suffix in text_ext or not root.is_dir():
                    self.text_files.append((name, p))
        if not self.text_files and not records:
            raise ValueError(f"data.paths {[str(p) for p in paths]} hold no {sorted(text_ext)}, .jsonl or .parquet files")
        self._records = {
            fmt: load_records(fmt, data_files=[str(f) for f in files], cache_dir=cache_dir / "hf")
            for fmt, files in sorted(records.items())
        }
        for fmt, ds in self._records.items():
            check_text_field(ds, self.text_field, f"the {fmt} files of data.paths")
        self.num_documents = len(self.text_files) + sum(len(ds) for ds in self._records.values())
        all_files = [p for _, p in self.text_files] + [f for files in records.values() for f in files]
        key = hashlib.sha256(f"{local_files_signature(all_files)}|{self.text_field}".encode()).hexdigest()
        self.fingerprint = f"files-{key[:10]}"
        self.origin = f"data.paths={[str(p) for p in paths]}"   # what an error about the documents names
        self.max_bad_fraction = cfg.get("max_bad_fraction", 0.01)

    def for_tokenizer(self, tokenizer) -> "FilesSource":
        return self

    def documents(self) -> Iterator[tuple[str, str]]:
        undecodable = BadDocuments("text files with bytes that are not UTF-8 (decoded with replacements)",
                                   self.max_bad_fraction)
        for name, path in self.text_files:
            data = path.read_bytes()
            try:
                text, bad = data.decode("utf-8"), False
            except UnicodeDecodeError:
                text, bad = data.decode("utf-8", errors="replace"), True
            undecodable.add(bad, name)
            yield name, text
        undecodable.check()
        for fmt, ds in self._records.items():
            missing = BadDocuments(f"{fmt} records without a {self.text_field!r} field", self.max_bad_fraction)
            for i, text in record_texts(ds, self.text_field, f"the {fmt} files of data.paths", audit=missing):
                yield f"{fmt}:{i}", text
            missing.check()


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)

