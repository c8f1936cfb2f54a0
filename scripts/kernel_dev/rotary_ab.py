"""The fused rotary kernel (kernels/rotary.py) against apply_rope's tensor operations, on CUDA.

    python scripts/kernel_dev/rotary_ab.py --out benchmarks/training

gpt2-small (rotary positions, the model's default), bf16 autocast, fused AdamW, eager (the default
`trainer.compile=false`), 16K tokens a step: the bare training step of bench_train.py (forward with
the loss, backward, optimizer step, zero_grad on batches already on the GPU; CUDA events) for each
attention in `--attention` and each way of rotating q and k:
- `kernel`: the projection rotated into a new fused tensor, one kernel each way; q, k, v stay
  slices of one tensor, so our attention's backward also writes one packed gradient;
- `ops`: apply_rope's tensor operations on q and k (what the model ran before, and still runs on
  the CPU and under torch.compile), selected here by making `model.layers.fuses_rotary` say no.
Every figure is the median of `--rounds` rounds, each round timing every configuration in turn:
the A/B of one change, so a development measurement rather than a benchmark of the product.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))            # scripts/, for _common
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))   # for the training benchmark's step
import _common  # noqa: F401,E402  (puts the repo root on sys.path)
import torch  # noqa: E402

from _common import (add_out_argument, console, environment, markdown_table, run_cli, write_json,  # noqa: E402
                     write_text)
from bench_train import GPT2, Timer, build, compose_cfg, loop_step  # noqa: E402


def measure(attention: list[str], lengths: list[int], tokens: int, steps: int, warmup: int, rounds: int) -> list:
    import model.layers as layers

    device = torch.device("cuda")
    fused = layers.fuses_rotary
    timer = Timer(device)
    configs = []
    for T in lengths:
        for name in attention:
            cfg = compose_cfg(GPT2 + [f"attention={name}", f"trainer.seq_len={T}",
                                      f"trainer.batch_size={tokens // T}", "trainer.compile=false"])
            model, step_model, optimizer = build(cfg, name, device)
            step = loop_step(0, cfg, model, step_model, optimizer, device)
            for way in ("kernel", "ops"):
                configs.append({"T": T, "attention": name, "rotary": way, "step": step, "times": []})
    try:
        for r in range(rounds):
            for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                layers.fuses_rotary = fused if c["rotary"] == "kernel" else (lambda qkv: False)
                timer(c["step"], warmup)
                c["times"].append(timer(c["step"], steps))
    finally:
        layers.fuses_rotary = fused
    return [{"T": c["T"], "attention": c["attention"], "rotary": c["rotary"], "ms": 1e3 * statistics.median(c["times"]),
             "rounds_ms": [1e3 * t for t in c["times"]], "tokens_per_s": tokens / statistics.median(c["times"])}
            for c in configs]


def main(argv: list[str] | None = None) -> dict:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--attention", default="sdpa,flash", help="comma-separated attention names")
    parser.add_argument("--lengths", default="1024,4096", help="comma-separated sequence lengths")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens a step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps a round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each timing")
    parser.add_argument("--rounds", type=int, default=3)
    add_out_argument(parser, "rotary_ab")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise ValueError("rotary_ab.py measures the CUDA kernel: it needs a GPU")
    rows = measure(args.attention.split(","), [int(t) for t in args.lengths.split(",")], args.tokens, args.steps,
                   args.warmup, args.rounds)
    ops = {(r["T"], r["attention"]): r["ms"] for r in rows if r["rotary"] == "ops"}
    table = markdown_table(["T", "attention", "rotary", "step ms", "tokens/s", "ops / this"],
                           [[r["T"], r["attention"], r["rotary"], f"{r['ms']:.2f}", f"{r['tokens_per_s']:,.0f}",
                             f"{ops[r['T'], r['attention']] / r['ms']:.3f}"] for r in rows])
    console().print(table)
    result = {"meta": environment(torch.device("cuda")), "rows": rows}
    if args.out:
        write_json(args.out / "rotary_ab.json", result)
        write_text(args.out / "rotary_ab.md", table + "\n")
    return result


if __name__ == "__main__":
    run_cli(main)
