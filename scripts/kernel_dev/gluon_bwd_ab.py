"""Backward-only milliseconds of the plan's Gluon backward at the training shapes, for A/B runs of
two source trees: run it once from each tree, alternating, and compare the lines.

    FLASHTRAIN_AUTOTUNE=0 python scripts/kernel_dev/gluon_bwd_ab.py LABEL     # one JSON line per shape
    python scripts/kernel_dev/gluon_bwd_ab.py m64-fma2 --shapes 1 --softcap 50 --block-m 64 --exp2-on-fma 2
    python scripts/kernel_dev/gluon_bwd_ab.py d --shapes 1 --dropout 0.1 --rounds 2 \
        --tiles '{"s2": {"STAGES": 2, "DQ_BUFS": 2}, "plan": {}}'

Each shape is gpt2-small's or a 128-wide head's attention, bf16, q, k, v views of one fused QKV
projection (as the model passes them), our Triton forward then the Gluon backward
(kernel=("triton", "gluon")). The backward is what it adds to the forward in forward+backward calls
(scripts/_common.py, pass_timer: CUDA events before, between and after each call, medians). The
forward's tiles do not matter here; FLASHTRAIN_AUTOTUNE=0 only saves its tuning. Within one tree,
--softcap, --dropout, --atomic, --block-m and --exp2-on-fma set the soft cap, the dropout probability,
dQ's sum in arrival order, the backward's query tile and how many of every 4 exponentials of its
unmasked steps the FMA units take (kernels/exp2.py), for A/B lines of settings rather than trees;
--shapes N times the first N shapes only, --pick I,J those of SHAPES. --tiles names settings of the
backward's tiles and schedule (each a dict over the call's own, kernels.gluon.backward.config_for),
timed in turn --rounds times in one process, so that the settings alternate on one warm GPU; its
lines are labelled LABEL/NAME.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
from _common import argument_parser, pass_timer, run_cli

SHAPES = [(4, 4096, 12, 12, 64, True), (1, 16384, 12, 12, 64, True), (4, 4096, 12, 12, 64, False),
          (16, 1024, 12, 12, 64, True), (4, 4096, 16, 16, 128, True), (1, 16384, 16, 16, 128, True),
          (4, 4096, 32, 8, 128, True)]   # B, T, H, Hkv, D, causal


def tile_tables() -> dict:
    """The Gluon backward's tile tables (its TILE_TABLES) as they are now: what `use_tiles` starts from."""
    from kernels.gluon import backward

    return {name: dict(getattr(backward, name)) for name in backward.TILE_TABLES}


def use_tiles(head_dim: int, setting: dict, tables: dict) -> None:
    """The Gluon backward's tiles at `head_dim` set to `setting` over `tables` (`tile_tables()` as
    they were, so that settings do not stack), in every table, so that dropout's and arrival-order
    calls take it too; for this process, calls forgotten."""
    from kernels import flash_op
    from kernels.gluon import backward

    for name, table in tables.items():
        setattr(backward, name, {**table, head_dim: {**table.get(head_dim, {}), **setting}})
    flash_op.forget_calls()   # a call signature keeps the kernels it first compiled


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("label", nargs="?", default="this", help="names this tree's lines (default: this)")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="time the first N shapes")
    parser.add_argument("--pick", type=lambda text: [int(i) for i in text.split(",")], default=None,
                        help="comma-separated indices into SHAPES to time instead (0: gpt2-small at 4K)")
    parser.add_argument("--softcap", type=float, default=0.0, help="the soft cap (0: none)")
    parser.add_argument("--block-m", type=int, default=None, help="the backward's query tile (default: the plan's)")
    parser.add_argument("--exp2-on-fma", type=int, default=None,
                        help="of every 4 exponentials of an unmasked step, how many on the FMA units (default: exp2.ON_FMA's)")
    parser.add_argument("--dropout", type=float, default=0.0, help="the attention dropout probability (0: none)")
    parser.add_argument("--tiles", type=json.loads, default={"": {}},
                        help='JSON {name: {tile or schedule key: value}}: settings timed in turn (default: the plan\'s)')
    parser.add_argument("--rounds", type=int, default=1, help="times each --tiles setting is timed, alternating")
    parser.add_argument("--atomic", action="store_true", help="dQ summed in arrival order (deterministic=False)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device: the Gluon backward runs on a Hopper GPU")
    timer, _ = pass_timer(torch.device("cuda"))
    from bench_attention import fused_inputs

    from kernels import exp2, flash_op
    from kernels.gluon import backward

    tables = tile_tables()
    block_m = {} if args.block_m is None else {"BLOCK_M": args.block_m}
    for B, T, H, Hkv, D, causal in (SHAPES[:args.shapes] if args.pick is None else [SHAPES[i] for i in args.pick]):
        if args.exp2_on_fma is not None:
            exp2.ON_FMA = {**exp2.ON_FMA, ("gluon-bwd", D, "softcap"): args.exp2_on_fma}
        leaf, (q, k, v), dout = fused_inputs(B, T, H, Hkv, D, False, "cuda", torch.bfloat16)
        shape = f"B{B} T{T} {H}/{Hkv}x{D} {'causal' if causal else 'full'}"
        for round_ in range(args.rounds):
            for name, setting in args.tiles.items():
                # the setting (after --block-m) goes over the call's own tiles, dropout's and arrival order's included
                use_tiles(D, {**block_m, **setting}, tables)
                ms = timer(lambda: flash_op.flash_attention(q, k, v, causal=causal, kernel=("triton", "gluon"),
                                                            softcap=args.softcap or None, dropout_p=args.dropout,
                                                            deterministic=not args.atomic),
                           lambda out: torch.autograd.grad(out, [leaf], dout))
                print(json.dumps({"who": f"{args.label}/{name}" if name else args.label, "round": round_,
                                  "shape": shape, "softcap": args.softcap, "dropout": args.dropout, "atomic": args.atomic,
                                  "tiles": backward.config_for(D, args.dropout > 0, deterministic=not args.atomic,
                                                             softcap=args.softcap > 0),
                                  "bwd_ms": round(ms["bwd"], 4), "fwd+bwd_ms": round(ms["fwd+bwd"], 4)}), flush=True)


if __name__ == "__main__":
    run_cli(main)
