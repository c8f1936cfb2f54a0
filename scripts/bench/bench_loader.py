"""Tokens/s of the data loader alone (window sampling from the token cache to int64 tensors).

    python scripts/bench/bench_loader.py                       # default corpus, seq_len 65536, batch 4
    python scripts/bench/bench_loader.py data=pg19 tokenizer=bpe --seq-len 16384 --batch-size 8

The GPU must never wait on data: the result is set beside what a gpt2-small training step
consumes on the H200 (a bare nanoGPT-style step with SDPA + compile: 419K tokens/s) and should be at least 10x it.
Writes <out>/loader_<device>.json (--out: default outputs/bench_loader/; the committed one with
--out benchmarks/cpu). Runs on CPU; `--device cuda` adds the
pinned host-to-device copy to what is timed.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import add_out_argument, device_slug, environment, print_table, require_positive, run_cli, write_json

GPT2_SMALL_H200_TOKENS_PER_S = 419_000   # bare nanoGPT-style step on an H200: training consumption to stay ahead of


def bench(sampler, batch_size: int, n_batches: int, device: torch.device) -> dict:
    sampler.next_batch(batch_size)                        # first touch of the memory map
    start = time.perf_counter()
    for _ in range(n_batches):
        x, y = sampler.next_batch(batch_size)
        if device.type == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    tokens = n_batches * batch_size * sampler.seq_len
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def main(argv: list[str]) -> None:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (data=..., tokenizer=...)")
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_out_argument(parser, "bench_loader")
    args = parser.parse_args(argv)
    require_positive(args, "seq_len", "batch_size", "batches")   # --batches 0 would time nothing: 0 tokens/s

    from training.builders import build_data
    from training.config import compose
    from training.config.checks import validate_config

    cfg = compose(args.overrides)
    validate_config(cfg)   # train.py's checks, before the tokenizer trains or the cache is written
    device = torch.device(args.device)
    bundle = build_data(cfg, seq_len=args.seq_len, seed=cfg.seed, seq_len_from="--seq-len")
    result = bench(bundle.train, args.batch_size, args.batches, device)
    result.update(
        seq_len=args.seq_len, batch_size=args.batch_size, batches=args.batches, data=bundle.fingerprint,
        train_tokens=bundle.train_tokens,
        ratio_to_gpt2_small_h200=result["tokens_per_s"] / GPT2_SMALL_H200_TOKENS_PER_S,
        environment=environment(device),
    )
    out = args.out / f"loader_{device_slug(device)}.json"
    write_json(out, result)
    print_table("loader throughput", ["data", "seq_len", "batch", "tokens/s", "x gpt2-small H200 step"],
                [(bundle.fingerprint, args.seq_len, args.batch_size, f"{result['tokens_per_s']:,.0f}",
                  f"{result['ratio_to_gpt2_small_h200']:.0f}x")])
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main)
