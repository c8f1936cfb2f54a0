"""Export a checkpoint to a Hugging Face folder (safetensors, config.json, tokenizer files).

    python scripts/export_hf.py runs/a hf/a                # the run's newest checkpoint
    python scripts/export_hf.py runs/a/checkpoints/step_00000300.pt hf/a --dtype bfloat16

The folder loads with `transformers`: AutoModelForCausalLM.from_pretrained("hf/a") and
AutoTokenizer.from_pretrained("hf/a"). Learned positions + LayerNorm + GELU export as GPT-2,
RoPE + RMSNorm + SwiGLU as Llama; another combination is refused in one line (exit status 2)
naming the option that does not map (training/interop/huggingface.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)

from _common import existing_path, require_output_dir, run_cli


def main(argv: list[str]) -> Path:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("checkpoint", type=existing_path, help="a checkpoint file, a weights-only model.safetensors, "
                        "or a run dir (its newest checkpoint)")
    parser.add_argument("out_dir", type=Path, help="the folder to write (must not hold the files it writes: "
                        "config.json, model.safetensors, the tokenizer's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    require_output_dir(args.out_dir, "out_dir")
    from training.interop.huggingface import check_export_folder, export_hf, hf_architecture

    check_export_folder(args.out_dir)   # before the checkpoint is read

    from _eval import load_for_eval

    model, _, tokenizer, _, path = load_for_eval(argparse.Namespace(checkpoint=args.checkpoint, device="cpu",
                                                                     attention=None))
    out = export_hf(model, tokenizer, args.out_dir, args.dtype)
    print(f"exported {path} as {hf_architecture(model.config)} ({args.dtype}) to {out}")
    return out


if __name__ == "__main__":
    run_cli(main)
