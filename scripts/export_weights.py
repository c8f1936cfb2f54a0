"""Weights only, from any checkpoint: a safetensors file evaluation loads on one GPU or a CPU.

    python scripts/export_weights.py runs/a          # its newest usable checkpoint
    python scripts/export_weights.py runs/a/checkpoints/step_00000300.pt step300.safetensors

The default output is `model_step_<N>.safetensors` in the checkpoint's run folder (beside the
`model.safetensors` a finished run writes itself, which is never replaced by default). An existing
output file is refused unless --force. Load it with
`training.evaluate.load_model_for_eval("runs/a/model_step_00000300.safetensors")` or
`scripts/generate.py runs/a/model_step_00000300.safetensors`.
"""
from __future__ import annotations

from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
from _common import argument_parser, existing_path, require_output_file, run_cli


def main(argv: list[str]) -> Path:
    parser = argument_parser(__doc__)
    parser.add_argument("checkpoint", type=existing_path, help="a checkpoint file, or a run folder (its newest checkpoint)")
    parser.add_argument("out", type=Path, nargs="?", default=None,
                        help="the .safetensors file to write (default <run>/model_step_<N>.safetensors)")
    parser.add_argument("--force", action="store_true", help="replace an existing output file")
    args = parser.parse_args(argv)
    require_output_file(args.out, "out")
    if args.out is not None and args.out.exists() and not args.force:
        raise ValueError(f"{args.out} exists; pass --force to replace it")

    from training.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint
    from training.export import save_weights

    source = args.checkpoint
    if source.is_dir():
        found = latest_checkpoint(checkpoint_dir(source))
        if found is None:
            raise ValueError(f"{source} holds no usable checkpoint under checkpoints/")
        path, state = found
    else:
        path, state = source, load_checkpoint(source)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    out = args.out or run_dir / f"model_step_{state['step']:08d}.safetensors"
    if out.exists() and not args.force:
        raise ValueError(f"{out} exists; name another output file, or pass --force to replace it")
    save_weights(state["model"], out, state["config"])
    print(f"wrote {out} (weights of {path}, step {state['step']})")
    return out


if __name__ == "__main__":
    run_cli(main)
