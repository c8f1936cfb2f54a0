"""Tokenizers behind one small interface: bytes (no training), byte-level BPE, a tokenizer.json.

Every tokenizer has `encode(str) -> list[int]`, `decode(list[int]) -> str`, `vocab_size`,
`eot_id` (the end-of-document token put between documents), `name` and `fingerprint`
(what the token cache is keyed by), and `encode_arrays(texts)` for bulk tokenization.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from data.digest import file_sha256

log = logging.getLogger(__name__)
EOT_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"   # the copy a run keeps in its run.dir
BPE_VERSION = 1   # bump when train_bpe changes, so cached BPEs are retrained


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id (uint16 up to 65536 ids)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus <|endoftext|> as 256; nothing to train or download."""

    name = "bytes"
    fingerprint = "bytes"
    eot_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                run.append(i)
                continue
            if i != self.eot_id:
                raise ValueError(f"token id {i} is outside the bytes tokenizer's vocab of {self.vocab_size}")
            out.append(run.decode("utf-8", errors="replace") + EOT_TOKEN)
            run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class JsonTokenizer:
    """A `tokenizers` tokenizer.json (trained here as BPE, or any pretrained one)."""

    def __init__(self, path: str | os.PathLike, name: str, eot_token: str = EOT_TOKEN):
        from tokenizers import Tokenizer

        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ValueError(f"tokenizer file not found: {self.path}")
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 (the library raises a bare Exception for any bad file)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"tokenizer file {self.path} is not a tokenizer.json the tokenizers library reads "
                             f"({reason})") from None
        eot = self._tok.token_to_id(eot_token)
        if eot is None:
            raise ValueError(
                f"tokenizer {self.path} has no end-of-document token {eot_token!r}; "
                f"set tokenizer.eot_token to one of its special tokens"
            )
        self.name = name
        self.eot_id = eot
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.fingerprint = f"{name}{self.vocab_size}-{file_sha256(self.path)[:10]}"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch runs on all cores (Rust threads).
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def train_bpe(texts: Iterator[str], vocab_size: int, min_frequency: int, out_path: Path, show_progress: bool,
              split_digits: bool = False) -> None:
    """Byte-level BPE (GPT-2 style pre-tokenization) with <|endoftext|> as its only special token.

    `split_digits`: every digit its own token, never merged (as LLaMA's tokenizer does). A number is
    then as many tokens as it has digits, all ten of them seen everywhere, where GPT-2's merges cut
    each number into chunks by their frequency in the corpus, most of them rare tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, out_path)


def build_tokenizer(cfg, source, cache_dir: Path, progress: bool = True):
    """Tokenizer named by `cfg.name`; a BPE is trained once per (corpus, settings) and reused."""
    name = cfg.name
    if name == "bytes":
        return ByteTokenizer()
    if name == "pretrained":
        if not cfg.get("path"):
            raise ValueError("tokenizer=pretrained needs tokenizer.path=<tokenizer.json>")
        return JsonTokenizer(cfg.path, "pretrained", cfg.get("eot_token") or EOT_TOKEN)
    if name == "bpe":
        return _cached_bpe(cfg, source, cache_dir, progress)
    raise ValueError(f"unknown tokenizer.name {name!r} (expected bytes, bpe or pretrained)")


def configured_vocab_size(cfg) -> int:
    """The vocabulary size the `tokenizer` config gives, without a corpus: the bytes tokenizer's 257,
    a BPE's configured `vocab_size` (what training asks the trainer for), a pretrained file's own.
    For tools that feed random tokens and need the model sized as training would size it."""
    if cfg.name == "bytes":
        return ByteTokenizer.vocab_size
    if cfg.name == "bpe":
        return int(cfg.vocab_size)
    if cfg.name == "pretrained":
        if not cfg.get("path"):
            raise ValueError("tokenizer=pretrained needs tokenizer.path=<tokenizer.json>")
        return JsonTokenizer(cfg.path, "pretrained", cfg.get("eot_token") or EOT_TOKEN).vocab_size
    raise ValueError(f"unknown tokenizer.name {cfg.name!r} (expected bytes, bpe or pretrained)")


def load_run_tokenizer(cfg, folders) -> "ByteTokenizer | JsonTokenizer | None":
    """The tokenizer a run kept (training copies its file into run.dir) in the first of `folders`
    holding one; the bytes tokenizer from its name alone; None when the run kept no copy (runs
    older than this)."""
    if cfg.name == "bytes":
        return ByteTokenizer()
    for folder in folders:
        path = Path(folder) / TOKENIZER_FILE
        if path.is_file():
            return JsonTokenizer(path, cfg.name, cfg.get("eot_token") or EOT_TOKEN)
    return None


def _cached_bpe(cfg, source, cache_dir: Path, progress: bool) -> JsonTokenizer:
    vocab_size, min_frequency = int(cfg.vocab_size), int(cfg.min_frequency)
    if vocab_size <= 257:
        raise ValueError(f"tokenizer.vocab_size={vocab_size} must exceed the 256 byte symbols + <|endoftext|>")
    train_bytes, split_digits = cfg.get("train_max_bytes"), bool(cfg.get("split_digits", False))
    # split_digits joins the key only when on, so the BPEs cached before it existed keep their keys
    settings = f"{source.fingerprint}|{vocab_size}|{min_frequency}|{train_bytes}|{BPE_VERSION}"
    key = hashlib.sha256((settings + ("|digits" if split_digits else "")).encode()).hexdigest()[:12]
    path = Path(cache_dir).expanduser() / "tokenizers" / f"bpe{vocab_size}-{source.name}-{key}" / "tokenizer.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        if progress:
            log.info("training a %d-token byte-level BPE on %s -> %s", vocab_size, source.fingerprint, path)
        # tokenizers' own bars print blank lines when not on a terminal: only draw them on one
        train_bpe(_capped_texts(source, train_bytes), vocab_size, min_frequency, path,
                  progress and sys.stdout.isatty() and sys.stderr.isatty(), split_digits)
    return JsonTokenizer(path, "bpe")


def _capped_texts(source, max_bytes: int | None) -> Iterator[str]:
    """The source's texts, stopping once `max_bytes` of UTF-8 have been handed out."""
    seen = 0
    for _, text in source.documents():
        yield text
        seen += len(text.encode("utf-8"))
        if max_bytes is not None and seen >= max_bytes:
            return
