"""Generate text from a trained checkpoint: prompts in, completions out, through a KV cache.

    python scripts/generate.py runs/a --prompt "def main(" --max-new-tokens 200 --temperature 0.8 --top-p 0.95
    python scripts/generate.py runs/a/checkpoints/step_00000300.pt --prompt-file p1.txt --prompt-file p2.txt \\
        --num-samples 4 --seed 1 --stop $'\\n\\n' --jsonl out.jsonl

The checkpoint's tokenizer (rebuilt from its config, as training built it) encodes the prompts.
Prompts of the same token length run together, up to --batch-size at a time (the attention
functions take no padding mask); each row stops at its stop string, at the end-of-document token, or after
--max-new-tokens. A prompt longer than the model's context is refused (exit status 2).

On a GPU the weights are cast to the run's precision (bf16) and each one-token step is replayed
from a CUDA graph over a static KV cache (--decode-mode graph, model/generation.py); on a CPU the
steps run eagerly. Greedy decoding gives the same tokens in every mode up to the attention's
summation order.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import argument_parser, existing_file, existing_path, require_output_file, run_cli, write_text

DECODE_MODES = ("auto", "eager", "static", "graph")   # auto: graph on CUDA, eager elsewhere


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    parser.add_argument("checkpoint", type=existing_path, help="a checkpoint file, a weights-only model.safetensors, "
                        "a run dir (its newest checkpoint) or outputs/latest")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    parser.add_argument("--prompt-file", action="append", default=[], type=existing_file("--prompt-file", stdin=True),
                        help="a file whose whole text is one prompt, '-' for stdin (repeatable)")
    parser.add_argument("--num-samples", type=int, default=1, help="completions per prompt")
    parser.add_argument("--batch-size", type=int, default=16, help="most sequences decoded together")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop a completion at this string (repeatable)")
    parser.add_argument("--ignore-eot", action="store_true", help="keep going after the end-of-document token")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--attention", default=None, help="naive | sdpa | flash (default: auto for the device)")
    parser.add_argument("--decode-mode", default="auto", choices=DECODE_MODES,
                        help="eager | static (static KV cache) | graph (static cache + CUDA graph; "
                             "default auto: graph on CUDA, eager elsewhere)")
    parser.add_argument("--jsonl", type=Path, default=None, help="write one JSON object per completion here")
    args = parser.parse_args(argv)
    if min(args.num_samples, args.max_new_tokens, args.batch_size) < 1:
        raise ValueError("--num-samples, --max-new-tokens and --batch-size must be at least 1")
    if any(s == "" for s in args.stop):
        raise ValueError("--stop must not be empty")
    require_output_file(args.jsonl, "--jsonl")
    return args


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    for path in args.prompt_file:
        prompts.append(read_prompt_file(path))
    if not prompts:
        raise ValueError("no prompt: give --prompt TEXT or --prompt-file FILE")
    return prompts


def read_prompt_file(path: Path) -> str:
    """A --prompt-file's text ('-': stdin) as UTF-8: one that is not is refused in one line naming the
    flag and the file (the codec's own message names neither; stdin's failed later, when encoded)."""
    try:
        if str(path) != "-":
            return path.read_text(encoding="utf-8")
        if hasattr(sys.stdin, "reconfigure"):   # strict: not the locale's encoding, nor its surrogate escapes
            sys.stdin.reconfigure(encoding="utf-8", errors="strict")
        return sys.stdin.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text "
                         f"(byte 0x{exc.object[exc.start]:02x} at {exc.start})") from None


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """text up to (not including) the earliest stop string, and whether one was found."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(ends)], True) if ends else (text, False)


def decode_mode(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "graph" if device.type == "cuda" else "eager"
    if requested == "graph" and device.type != "cuda":
        raise ValueError(f"--decode-mode graph needs a CUDA device (the model is on {device.type}); use static or eager")
    return requested


def complete_batch(model, tokenizer, ids: list[list[int]], args, sampling, generator, device) -> list[dict]:
    """Decode one batch of equal-length prompts until every row has stopped."""
    from model.generation import decode

    prompt = torch.tensor(ids, device=device)
    new: list[list[int]] = [[] for _ in ids]
    reasons: list[str | None] = [None] * len(ids)
    for _, chosen in decode(model, prompt, args.max_new_tokens, sampling, generator=generator,
                            vocab_size=tokenizer.vocab_size, mode=args.decode_mode):
        for row, token in enumerate(chosen.tolist()):
            if reasons[row] is not None:
                continue
            if token == tokenizer.eot_id and not args.ignore_eot:
                reasons[row] = "eot"
                continue
            new[row].append(token)
            if args.stop and cut_at_stop(tokenizer.decode(new[row]), args.stop)[1]:
                reasons[row] = "stop"
        if all(reasons):
            break
    results = []
    for row, tokens in enumerate(new):
        text, _ = cut_at_stop(tokenizer.decode(tokens), args.stop)
        results.append({"completion": text, "new_tokens": len(tokens), "stop_reason": reasons[row] or "length"})
    return results


def main(argv: list[str]) -> list[dict]:
    args = parse_args(argv)
    from model.generation import Sampling
    from _eval import load_for_eval

    sampling = Sampling(args.temperature, args.top_k, args.top_p)   # bad values refused before loading
    prompts = read_prompts(args)
    model, cfg, tokenizer, device, path = load_for_eval(args)
    args.decode_mode = decode_mode(args.decode_mode, device)
    if cfg.trainer.precision == "bf16":   # the weights themselves: a CUDA graph cannot replay autocast's casts
        model.to(torch.bfloat16)
    encoded = [tokenizer.encode(p) for p in prompts]
    limit = model.config.max_seq_len
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {i + 1} is empty")
        if len(ids) >= limit:
            raise ValueError(f"prompt {i + 1} has {len(ids):,} tokens; the model's context is {limit:,} "
                             f"(model.max_seq_len), leaving no room to generate")
    longest = max(len(ids) for ids in encoded)
    if longest + args.max_new_tokens > limit:   # decode stops at the context: said, not silently
        print(f"note: --max-new-tokens {args.max_new_tokens:,}: the model's context ({limit:,}, model.max_seq_len) "
              f"leaves {limit - longest:,} after the longest prompt ({longest:,} tokens); generating at most that",
              file=sys.stderr)
    groups: dict[int, list[int]] = defaultdict(list)   # token length -> rows
    rows = [(i, ids) for i, ids in enumerate(encoded) for _ in range(args.num_samples)]
    for r, (_, ids) in enumerate(rows):
        groups[len(ids)].append(r)
    generator = torch.Generator(device).manual_seed(args.seed)
    results: list[dict | None] = [None] * len(rows)
    batches = [rows_[i:i + args.batch_size] for rows_ in groups.values() for i in range(0, len(rows_), args.batch_size)]
    for members in batches:
        done = complete_batch(model, tokenizer, [rows[r][1] for r in members], args, sampling, generator, device)
        for r, result in zip(members, done):
            i = rows[r][0]
            results[r] = {"prompt_index": i, "prompt": prompts[i], "prompt_tokens": len(encoded[i]), **result}
    if args.jsonl:   # atomically: a full disk leaves no partial file
        write_text(args.jsonl, "".join(json.dumps({**result, "checkpoint": str(path), "seed": args.seed}) + "\n"
                                       for result in results))
        print(f"wrote {len(results)} completions to {args.jsonl}")
    else:
        for r, result in enumerate(results):
            print(f"=== prompt {result['prompt_index'] + 1}"
                  f"{f', sample {r % args.num_samples + 1}' if args.num_samples > 1 else ''} "
                  f"({result['new_tokens']} new tokens, {result['stop_reason']}) ===")
            print(result["prompt"] + result["completion"])
    return results


if __name__ == "__main__":
    run_cli(main)
