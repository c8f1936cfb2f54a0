"""Weights only, from any checkpoint: a safetensors file evaluation loads on one GPU or a CPU.

    python scripts/export_weights.py runs/a/checkpoints/step_00000300.pt [out.safetensors]
    python scripts/export_weights.py runs/a          # its newest usable checkpoint

The default output is `model.safetensors` beside the checkpoint's run folder's checkpoints
(`runs/a/model.safetensors`). A finished run writes that file itself. Load it with
`training.evaluate.load_model_for_eval("runs/a/model.safetensors")`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
from _common import run_cli


def main(argv: list[str]) -> None:
    if not argv or len(argv) > 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        if not argv or argv[0] not in ("-h", "--help"):
            raise ValueError("expected a checkpoint file or run folder, and optionally an output path")
        return
    from training.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint
    from training.export import WEIGHTS_NAME, save_weights

    source = Path(argv[0])
    if source.is_dir():
        found = latest_checkpoint(checkpoint_dir(source))
        if found is None:
            raise ValueError(f"{source} holds no usable checkpoint under checkpoints/")
        path, state = found
    else:
        path, state = source, load_checkpoint(source)
    out = Path(argv[1]) if len(argv) > 1 else path.parent.parent / WEIGHTS_NAME
    save_weights(state["model"], out, state["config"])
    print(f"wrote {out} (weights of {path}, step {state['step']})", file=sys.stdout)


if __name__ == "__main__":
    run_cli(main)
