"""Where one long training step spends its GPU time: the kernels, summed by name.

    python scripts/profile_step.py model=gpt2-small length=262144 features=ckpt+chunked

Same Hydra config as scripts/max_context.py (configs/max_context.yaml) plus `length`; one
step is run untimed (compiling the kernels), then one under torch.profiler. Prints the
kernels that took most GPU time, to set beside the FLOP count of benchmarks/ rates.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from _common import run_cli  # noqa: E402
from max_context import StepProbe, compose_config  # noqa: E402


def main(argv: list[str]) -> None:
    extra = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] in ("length", "impl")}
    rest = [a for a in argv if a.split("=", 1)[0] not in ("length", "impl")]
    cfg = compose_config(rest)
    length, impl = int(extra.get("length", 65536)), extra.get("impl", "flash")
    name = cfg.features if isinstance(cfg.features, str) else cfg.features[0]
    cfg.model = OmegaConf.merge(cfg.model, cfg.feature_sets[name])
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py needs CUDA: it profiles GPU kernels")
    probe = StepProbe(cfg, impl, torch.device("cuda"), None)
    print(f"{impl} · {name} · {length:,} tokens: warm-up step {probe._timed_step(length):.2f} s")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        probe._timed_step(length)
        wall = time.perf_counter() - began
    print(f"profiled step: {wall:.2f} s wall")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    run_cli(main)
