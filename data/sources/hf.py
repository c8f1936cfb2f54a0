"""Hugging Face datasets (`data=hf`, presets such as `data=pg19`): one document per record.

Hub names and local JSON lines / parquet files go through the same `datasets.load_dataset`
call, so the offline tests exercise the code path a hub dataset takes.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

from data.digest import files_content_sha256
from data.sources.audit import BadDocuments


def load_records(path: str, *, config: str | None = None, split: str = "train", data_files=None,
                 streaming: bool = False, revision: str | None = None, cache_dir: Path | None = None):
    """`datasets.load_dataset(...)` for one split, with its failure as one ValueError line."""
    import datasets

    local = [f for f in as_list(data_files) if Path(str(f)).expanduser().is_file()]
    if local and cache_dir is not None:
        # datasets keys its prepared copy of local files by path and mtime: an edit that keeps the
        # mtime (`cp -p`, `rsync -a`) would reuse stale records, so key the copy by content as well.
        cache_dir = Path(cache_dir) / f"content-{local_files_signature(local)[:16]}"
    verbosity = datasets.logging.get_verbosity()
    if local:   # a builder logs its own ERROR line for a file it cannot read; ours below names the file and why
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        return datasets.load_dataset(
            path, config, split=split, data_files=data_files, streaming=streaming, revision=revision,
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    except Exception as e:  # the library raises many types (network, missing split, bad files)
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        cause = e.__cause__ or e.__context__
        if cause is not None and str(cause).strip() and detail.startswith("An error occurred while generating"):
            detail = " ".join(str(cause).split())[:300]   # the builder's reason (a cast, a torn file), one line
        if isinstance(e, StopIteration):   # what the json/parquet builders raise on empty files
            detail = "no records (empty dataset?)"
        bad = first_bad_json_record(local) if path == "json" else None
        if bad is not None:   # the builder's own message names neither the file nor the line
            raise ValueError(bad) from None
        if local:   # the user's files, not the builder's name for them
            files = ", ".join(str(f) for f in local[:3]) + (f" and {len(local) - 3} more" if len(local) > 3 else "")
            raise ValueError(f"cannot read {files} as {path} records: {detail}") from None
        raise ValueError(f"cannot load dataset {path!r} (config={config}, split={split}): {detail}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def first_bad_json_record(files) -> str | None:
    """Where the first record of local JSON files that is not a JSON object is, as a sentence
    naming the file and the line (a .json file may also be one JSON document: a list of objects,
    or an object); None when every record is one."""
    import json

    for name in files:
        path = Path(str(name)).expanduser()
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            whole = json.loads(text)
        except ValueError:
            whole = None
        if isinstance(whole, dict) or (isinstance(whole, list) and all(isinstance(r, dict) for r in whole)):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                return f"{path}, line {number}: not valid JSON ({e.msg} at column {e.colno})"
            if not isinstance(record, dict):
                return f"{path}, line {number}: a JSON {type(record).__name__}, not an object (one record per line)"
    return None


def column_names(ds) -> list[str]:
    if ds.column_names is not None:
        return list(ds.column_names)
    first = next(iter(ds), None)   # streaming datasets may not know their features up front
    return [] if first is None else list(first)


def check_text_field(ds, text_field: str, what: str) -> None:
    """One-line errors for an empty dataset or a text field it does not have (naming the ones it has)."""
    columns = column_names(ds)
    if not columns:
        raise ValueError(f"{what} is empty")
    if text_field not in columns:
        raise ValueError(f"text field {text_field!r} not in {what}; its columns are {columns} (set data.text_field)")


def record_texts(ds, text_field: str, what: str, max_docs: int | None = None,
                 audit: BadDocuments | None = None) -> Iterator[tuple[int, str]]:
    """(index, text) for each record. A record without the field (or null) is an empty text,
    which the cache skips; `audit` counts those and fails past its threshold at the end."""
    for i, record in enumerate(ds.select_columns([text_field])):
        if max_docs is not None and i >= max_docs:
            break
        text = record[text_field]
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{what}: field {text_field!r} of record {i} is {type(text).__name__}, not text")
        if audit is not None:
            audit.add(text is None, f"record {i}")
        yield i, text or ""


def local_files_signature(paths) -> str:
    """Hash of the names and contents of the local files among `paths` (not their mtimes: a
    `touch` changes nothing, a same-size edit does); remote names hash as given."""
    names = sorted(str(p) for p in paths)
    local = [n for n in names if Path(n).expanduser().is_file()]
    listing = "\n".join(names)
    content = files_content_sha256([Path(n).expanduser() for n in local], local)
    return hashlib.sha256(f"{listing}|{content}".encode()).hexdigest()


def as_list(value) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, (str, Path)) else list(value)


class HFSource:
    name = "hf"

    def __init__(self, cfg, cache_dir: Path):
        if not cfg.get("dataset"):
            raise ValueError("data=hf needs data.dataset=<hub name, or json/parquet/text with data.data_files>")
        self.dataset_name = str(cfg.dataset)
        self.text_field = str(cfg.get("text_field", "text"))
        self.max_docs = cfg.get("max_docs")
        data_files = as_list(cfg.get("data_files"))
        for f in data_files:
            if "://" not in str(f) and not any(c in str(f) for c in "*?[") and not Path(str(f)).expanduser().exists():
                raise ValueError(f"data.data_files: {f} does not exist")
        # download=lazy reads the records through datasets' streaming mode while the token cache is
        # built: no prepared copy of the raw split on disk, but every record is still tokenized
        # before training starts (the key stays "streaming" so existing caches keep their names).
        settings = dict(
            config=cfg.get("config"), split=str(cfg.get("split", "train")), data_files=data_files or None,
            streaming=cfg.get("download", "full") == "lazy", revision=cfg.get("revision"),
        )
        self._ds = load_records(self.dataset_name, cache_dir=cache_dir / "hf", **settings)
        self.what = f"dataset {self.dataset_name!r} split {settings['split']!r}"
        if settings["streaming"]:
            self.num_documents = self.max_docs
            content = f"{settings}|{local_files_signature(data_files)}"   # hub revisions pin remote content
        else:
            self.num_documents = len(self._ds) if self.max_docs is None else min(len(self._ds), int(self.max_docs))
            content = self._ds._fingerprint   # datasets' own hash of the prepared files
        key = hashlib.sha256(f"{self.dataset_name}|{content}|{self.text_field}|{self.max_docs}".encode()).hexdigest()
        slug = self.dataset_name.replace("/", "_")[-40:]
        self.fingerprint = f"hf-{slug}-{key[:10]}"
        check_text_field(self._ds, self.text_field, self.what)
        self.max_bad_fraction = cfg.get("max_bad_fraction", 0.01)

    def for_tokenizer(self, tokenizer) -> "HFSource":
        return self

    def documents(self) -> Iterator[tuple[str, str]]:
        audit = BadDocuments(f"records of {self.what} without a {self.text_field!r} text", self.max_bad_fraction)
        for i, text in record_texts(self._ds, self.text_field, self.what, self.max_docs, audit):
            yield str(i), text
        audit.check()
