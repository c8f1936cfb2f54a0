"""Forward + backward calls of one attention setting, for Nsight Compute to profile where a kernel waits.

Timing variants tells how long a step takes, not what it waits for; the profiler's warp-state
samples, per SASS instruction, do. This script only makes the calls; `ncu` picks the kernel:

    ncu --clock-control none --kernel-name gluon_bwd_kernel --launch-skip 2 --launch-count 1 \
        --set full --import-source no -o none -f python scripts/kernel_dev/profile_attention.py
    python scripts/kernel_dev/profile_attention.py --softcap 50      # the same, soft-capped
    ncu -i none.ncu-rep --page source --csv --print-source sass > none_sass.csv   # stalls per instruction

The calls are gpt2-small's attention at 4K (B 4, T 4096, 12 heads of 64, causal; --batch,
--tokens, --heads, --head-dim, --full to change it), bf16, through the plan's kernels or `--kernel`.
--calls N makes N forward + backward calls after one that compiles (--launch-skip then skips the
compiling call's launches); --tiles sets the Gluon backward's tiles and schedule as gluon_bwd_ab.py's.
`--clock-control none`: the GPU keeps its own clocks, as in every timing.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
from _common import argument_parser, run_cli


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--full", action="store_true", help="no causal mask")
    parser.add_argument("--softcap", type=float, default=0.0, help="the soft cap (0: none)")
    parser.add_argument("--dropout", type=float, default=0.0, help="the attention dropout probability (0: none)")
    parser.add_argument("--kernel", default="auto", help="auto | triton | gluon, or FORWARD,BACKWARD")
    parser.add_argument("--calls", type=int, default=2, help="forward + backward calls after the compiling one")
    parser.add_argument("--tiles", type=json.loads, default=None,
                        help='JSON {tile or schedule key: value} over the Gluon backward\'s own (gluon_bwd_ab.py --tiles)')
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device: the profiled kernels run on a GPU")
    from bench_attention import fused_inputs
    from gluon_bwd_ab import tile_tables, use_tiles

    from kernels import flash_op

    if args.tiles:
        use_tiles(args.head_dim, args.tiles, tile_tables())

    kernel = tuple(args.kernel.split(",")) if "," in args.kernel else args.kernel
    leaf, (q, k, v), dout = fused_inputs(args.batch, args.tokens, args.heads, args.heads, args.head_dim, False,
                                         "cuda", torch.bfloat16)
    for _ in range(1 + args.calls):
        out = flash_op.flash_attention(q, k, v, causal=not args.full, kernel=kernel,
                                       softcap=args.softcap or None, dropout_p=args.dropout)
        torch.autograd.grad(out, [leaf], dout)
    torch.cuda.synchronize()
    print(f"{1 + args.calls} forward + backward calls made", flush=True)


if __name__ == "__main__":
    run_cli(main)
