"""Documents, tokens and document-length distribution of a data source under a tokenizer.

    python scripts/data_stats.py                                  # the default corpus (stdlib, bytes)
    python scripts/data_stats.py data=files data.paths=[my/dir] tokenizer=bpe --json stats.json

Arguments are train.py's Hydra overrides (the same builders run: the tokenizer is trained and
the token cache written if they are not cached yet, so this also works as a `prepare` step).
"""
from __future__ import annotations

import sys
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
import numpy as np

from _common import markdown_table, print_table, require_output_file, run_cli, write_json, write_text

PERCENTILES = (0, 10, 25, 50, 75, 90, 100)


def data_stats(bundle) -> dict:
    """Counts and length percentiles (tokens per document, EOT excluded) of a DataBundle."""
    cache = bundle.cache
    lengths = np.diff(cache.offsets) - 1
    n_bytes = cache.manifest.get("n_bytes")
    edges = 2 ** np.arange(0, int(np.ceil(np.log2(lengths.max() + 1))) + 1)
    counts, _ = np.histogram(lengths, bins=np.concatenate([[0], edges]))
    return {
        "fingerprint": bundle.fingerprint,
        "cache": str(cache.path),
        "vocab_size": bundle.vocab_size,
        "documents": cache.n_docs,
        "tokens": cache.n_tokens,
        "train_tokens": bundle.train_tokens,
        "val_tokens": bundle.val_tokens,
        "val_documents": bundle.validation.stream.n_docs if bundle.validation else 0,
        "bytes": n_bytes,
        "bytes_per_token": None if not n_bytes else n_bytes / (cache.n_tokens - cache.n_docs),
        "doc_tokens_mean": float(lengths.mean()),
        "doc_tokens_percentiles": {str(p): int(v) for p, v in zip(PERCENTILES, np.percentile(lengths, PERCENTILES))},
        "doc_tokens_histogram": [
            {"from": int(lo), "below": int(hi), "documents": int(c)}
            for lo, hi, c in zip(np.concatenate([[0], edges[:-1]]), edges, counts) if c
        ],
    }


def main(argv: list[str]) -> None:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (data=..., tokenizer=...)")
    parser.add_argument("--json", type=Path, help="also write the statistics as JSON here")
    parser.add_argument("--markdown", type=Path, help="also write the tables as Markdown here")
    args = parser.parse_args(argv)
    require_output_file(args.json, "--json")
    require_output_file(args.markdown, "--markdown")

    from training.builders import build_data
    from training.config import compose
    from training.config.checks import validate_config

    cfg = compose(args.overrides)
    validate_config(cfg)   # train.py's checks: a bad value is one line here too, before the tokenizer trains
    stats = data_stats(build_data(cfg, seq_len=1, seed=cfg.seed))
    summary = [(k, f"{v:,}" if isinstance(v, int) else (f"{v:.3f}" if isinstance(v, float) else v))
               for k, v in stats.items() if not isinstance(v, (dict, list))]
    summary += [(f"doc tokens p{p}", f"{v:,}") for p, v in stats["doc_tokens_percentiles"].items()]
    histogram = [(f"[{h['from']:,}, {h['below']:,})", h["documents"]) for h in stats["doc_tokens_histogram"]]
    print_table("data", ["statistic", "value"], summary)
    print_table("document lengths (tokens)", ["tokens", "documents"], histogram)
    if args.json:
        write_json(args.json, stats)
    if args.markdown:
        write_text(args.markdown, markdown_table(["statistic", "value"], summary) + "\n"
                   + markdown_table(["tokens", "documents"], histogram))


if __name__ == "__main__":
    run_cli(main)
