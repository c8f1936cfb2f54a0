"""Where one long training step spends its GPU time: the kernels, summed by name.

    python scripts/bench/profile_step.py --attention flash model=gpt2-small length=262144 'features=[ckpt+chunked]'

The config is configs/profile_step.yaml: scripts/max_context.py's (so train.py's) plus
`length`; `--attention` (one implementation) and the first of `features` are profiled. One step runs untimed
(compiling the kernels), then one under torch.profiler. The table of the kernels that took
most GPU time is what to set beside a FLOP count and the rates of scripts/bench/bench_attention.py
(kernels/LOG.md does this for a million-token step).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
from _common import run_cli
from max_context import StepProbe, compose_config, fill_from_device_and_tokenizer, parse_args, validate, with_features


def main(argv: list[str]) -> None:
    args = parse_args(argv, script="profile_step", attention="flash", description=__doc__, writes=False)
    if len(args.attention) != 1:
        raise ValueError(f"--attention {','.join(args.attention)}: profile one implementation at a time")
    cfg = compose_config(args.overrides, args.attention, config_name="profile_step")
    if cfg.length > cfg.model.max_seq_len:
        raise ValueError(f"length={cfg.length}: must be at most model.max_seq_len ({cfg.model.max_seq_len})")
    if not torch.cuda.is_available():
        raise ValueError("profile_step.py needs CUDA: it profiles GPU kernels")
    device = torch.device("cuda")
    validate(cfg, device)
    fill_from_device_and_tokenizer(cfg, device)
    impl, name = cfg.impls[0], cfg.features[0]
    probe = StepProbe(with_features(cfg, name), impl, device, None)
    print(f"{impl} · {name} · {cfg.length:,} tokens: warm-up step {probe.timed_step(cfg.length):.2f} s")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        probe.timed_step(cfg.length)
        wall = time.perf_counter() - began
    print(f"profiled step: {wall:.2f} s wall")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    run_cli(main)
