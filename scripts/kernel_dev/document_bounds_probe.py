"""What turning document ids into per-token bounds costs each document-masked attention call, on CUDA.

    python scripts/kernel_dev/document_bounds_probe.py --out DIR

`kernels.masks.document_bounds` runs inside every masked call (each layer's, in training), before
the attention kernel. Two ways to compute it, timed side by side (do_bench, medians) on a few
layouts, after checking they agree: `flat`, the one kernels/masks.py uses (one cumsum over the
flattened batch numbers the runs, searchsorted finds each run's ends: device-wide kernels), and
`walk`, the scans it replaced (cummax / cummin along each row, which torch runs one thread block a
row: for B = 1, one block walking the whole window). kernels/LOG.md, 2026-12-07, has the numbers.
Writes DIR/document_bounds_<gpu>.json and .md.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common
import _common  # noqa: E402  (puts the repo root on sys.path)
import torch  # noqa: E402
from _common import (add_out_argument, argument_parser, device_slug, environment, markdown_table,  # noqa: E402
                     run_cli, write_json, write_text)

from kernels.masks import document_bounds  # noqa: E402

# (batch, window, document length): gpt2-small's long-context windows, uniform documents
LAYOUTS = [(1, 16384, 2048), (1, 32768, 700), (1, 65536, 2048), (4, 8192, 512)]


def walk(document_ids: torch.Tensor) -> torch.Tensor:
    """The bounds by scans along each row (kernels/masks.py before 2026-12-07)."""
    ids, n = document_ids, document_ids.shape[1]
    pos = torch.arange(n, device=ids.device, dtype=torch.int32).expand_as(ids)
    changes = ids[:, 1:] != ids[:, :-1]
    edge = torch.ones_like(ids[:, :1], dtype=torch.bool)
    start = torch.cummax(torch.where(torch.cat([edge, changes], 1), pos, 0), dim=1).values
    ends = torch.where(torch.cat([changes, edge], 1), pos + 1, n)
    end = torch.cummin(ends.flip(1), dim=1).values.flip(1)
    return torch.stack([start, end], dim=1).to(torch.int32).contiguous()


def main(argv: list[str]) -> None:
    parser = argument_parser(__doc__)
    add_out_argument(parser, "document_bounds_probe")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise ValueError("this probe times CUDA kernels: it needs a GPU")
    from triton.testing import do_bench
    device = torch.device("cuda")
    rows = []
    for b, n, doc in LAYOUTS:
        ids = (torch.arange(n, device=device) // doc).repeat(b, 1)
        if not torch.equal(walk(ids), document_bounds(ids)):
            raise AssertionError(f"flat and walk disagree at B={b}, T={n}, documents of {doc}")
        times = {name: do_bench(lambda f=f: f(ids), warmup=50, rep=300)
                 for name, f in (("walk", walk), ("flat", document_bounds))}
        rows.append(dict(batch=b, tokens=n, document=doc, walk_ms=times["walk"], flat_ms=times["flat"]))
        print(rows[-1], flush=True)
    meta = environment(device)
    stem = args.out / f"document_bounds_{device_slug(device)}"
    write_json(stem.with_suffix(".json"), dict(environment=meta, results=rows))
    table = markdown_table(["B", "T", "document", "walk ms", "flat ms"],
                           [[r["batch"], r["tokens"], r["document"], f"{r['walk_ms']:.3f}", f"{r['flat_ms']:.3f}"]
                            for r in rows])
    write_text(stem.with_suffix(".md"), f"# document_bounds: scans along each row against one flat cumsum\n\n"
               f"{meta['date']}, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
               f"commit {meta['git_commit']}, `{meta['command']}`. do_bench medians.\n\n{table}\n")


if __name__ == "__main__":
    run_cli(main)
