"""Weights only, from any checkpoint: a safetensors file evaluation loads on one GPU or a CPU.

    python scripts/export_weights.py runs/a          # its newest usable checkpoint
    python scripts/export_weights.py runs/a/checkpoints/step_00000300.pt step300.safetensors
    python scripts/export_weights.py runs/a/checkpoints/step_00000300.dcp --single-file step300.pt

A sharded checkpoint folder (`.dcp`, written by `trainer.parallel=fsdp`) is read on this one
process (no GPUs, no process group); `--single-file` also writes it as the single-file checkpoint
(model, optimizer, data position, lineage), which resumes and evaluates like any other.

The default output is `model_step_<N>.safetensors` in the checkpoint's run folder (beside the
`model.safetensors` a finished run writes itself, which is never replaced by default). An existing
output file is refused unless --force. Load it with
`training.builders.load_model_for_eval("runs/a/model_step_00000300.safetensors")` or
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
    parser.add_argument("--single-file", type=Path, default=None,
                        help="also write the checkpoint's whole state as one .pt file (from a .dcp folder)")
    args = parser.parse_args(argv)
    require_output_file(args.out, "out")
    require_output_file(args.single_file, "--single-file")
    if args.single_file is not None and args.single_file.exists() and not args.force:
        raise ValueError(f"{args.single_file} exists; pass --force to replace it")
    if args.out is not None and args.out.exists() and not args.force:
        raise ValueError(f"{args.out} exists; pass --force to replace it")

    from training.interop.weights import save_weights
    from training.run.resume import checkpoint_to_load
    from training.run.store import is_sharded, read_tensors, save_checkpoint

    path, state = checkpoint_to_load(args.checkpoint)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    out = args.out or run_dir / f"model_step_{state['step']:08d}.safetensors"
    if out.exists() and not args.force:
        raise ValueError(f"{out} exists; name another output file, or pass --force to replace it")
    if args.single_file is not None and not is_sharded(state):
        raise ValueError(f"{path} is already a single file: copy it instead of --single-file")
    state = read_tensors(path, state, optimizer=args.single_file is not None)   # verified above; a folder's shards read now
    save_weights(state["model"], out, state["config"])
    print(f"wrote {out} (weights of {path}, step {state['step']})")
    if args.single_file is not None:
        keep = {k: v for k, v in state.items() if k not in ("format_version", "checksum")}
        save_checkpoint(args.single_file, keep)
        print(f"wrote {args.single_file} (the whole state of {path})")
    return out


if __name__ == "__main__":
    run_cli(main)
