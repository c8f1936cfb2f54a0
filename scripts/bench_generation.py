"""Generation speed: decoding tokens/s through the KV cache, and the prefill time of a long prompt.

    python scripts/bench_generation.py                 # GPU: gpt2-small, bf16 weights, random tokens
    python scripts/bench_generation.py --attention flash model=gpt-1b    # one implementation, another model
    python scripts/bench_generation.py --smoke         # CPU-sized plumbing check (not a benchmark)

Decoding: a batch of B random prompts of N tokens is prefilled into the cache, then greedy
decoding runs --warmup-steps untimed steps and --decode-steps timed ones (model.generation's
`decode`, the path scripts/generate.py uses); tokens/s = B * decode steps / seconds. Each case runs
twice and the second is kept, so kernel compilation and autotuning are not timed. Prefill: one
prompt of --prefill-len tokens through the cache (last position's logits only), median of
--prefill-repeats after a warm-up. Random weights: speed does not depend on their values.
Writes <out>/generation_<device>.{json,md} (--out: default outputs/bench_generation/, committed
results with --out benchmarks), rewritten after every measurement.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import (add_out_argument, attention_list, device_slug, environment, error_text, markdown_table, print_table, run_cli,
                     tuning_note, write_json, write_text)

SMOKE = dict(model=["model=tiny", "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2"],
             batch_sizes=[1, 2], prompt_lens=[64, 128], prefill_len=256, decode_steps=4, warmup_steps=1,
             prefill_repeats=2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_case(model, batch: int, prompt_len: int, steps: int, warmup: int, device) -> dict:
    """Seconds of the prefill and of `steps` decode steps after `warmup` untimed ones."""
    from model.generation import Sampling, decode

    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device)
    sync(device)
    marks = [time.perf_counter()]
    for i, _ in enumerate(decode(model, prompt, 1 + warmup + steps, Sampling(temperature=0))):
        if i in (0, warmup, warmup + steps):
            sync(device)
            marks.append(time.perf_counter())
    prefill_s, decode_s = marks[1] - marks[0], marks[3] - marks[2]
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": steps,
            "tokens_per_s": batch * steps / decode_s, "ms_per_step": 1e3 * decode_s / steps}


def prefill_case(model, length: int, repeats: int, device) -> dict:
    from model import KVCache

    prompt = torch.randint(0, model.config.vocab_size, (1, length), device=device)
    times = []
    for _ in range(repeats + 1):                           # the first is the warm-up
        cache = KVCache(model.config.n_layer, 1, length)
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model(prompt, cache=cache, logits_to_keep=1)
        sync(device)
        times.append(time.perf_counter() - start)
        del cache
    median = statistics.median(times[1:])
    return {"prefill_s": median, "prefill_times_s": times[1:], "tokens_per_s": length / median}


def measure(fn, device, *args) -> dict:
    """Run one case; an out-of-memory or kernel error is recorded, not fatal to the sweep."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        fn(*args, device)                                  # warm-up: compile, autotune
        result = fn(*args, device)
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as exc:
        return {"error": error_text(exc)}
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def build(model_overrides: list[str], attention: str, device, dtype):
    from model import build_model
    from training.config import compose

    cfg = compose(model_overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab_size=50257, attention=attention)
    return model.to(device=device, dtype=dtype).eval(), cfg.model


def write_results(path: Path, result: dict) -> None:
    write_json(path.with_suffix(".json"), result)
    meta = result["environment"]
    dec_rows = [(r["attention"], r["batch"], f"{r['prompt_len']:,}",
                 r.get("error") or f"{r['tokens_per_s']:,.0f}", "-" if "error" in r else f"{r['ms_per_step']:.2f}",
                 "-" if "error" in r else f"{r['prefill_s']:.3f}") for r in result["decode"]]
    pre_rows = [(r["attention"], f"{r['prompt_len']:,}", r.get("error") or f"{r['prefill_s']:.3f}",
                 "-" if "error" in r else f"{r['tokens_per_s']:,.0f}") for r in result["prefill"]]
    text = (f"# Generation speed, {result['model']} ({meta['device']})\n\n"
            f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['git_commit']}, "
            f"weights in {result['dtype']}, random weights and prompts, greedy decoding through the KV cache."
            f"{tuning_note(meta)} Command: `{meta['command']}`.\n\n"
            f"## Decoding ({result['decode_steps']} timed steps after {result['warmup_steps']} untimed)\n\n"
            + markdown_table(["attention", "batch", "prompt", "tokens/s", "ms/step", "prefill s"], dec_rows)
            + "\n## Prefill of one prompt (last position's logits only)\n\n"
            + markdown_table(["attention", "prompt", "seconds", "tokens/s"], pre_rows))
    write_text(path.with_suffix(".md"), text)


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="*", metavar="key=value",
                        help="train.py's overrides for the model (default: model=gpt2-small)")
    parser.add_argument("--attention", dest="attentions", type=attention_list, default=["flash", "sdpa"],
                        help="comma-separated attention implementations (default flash,sdpa)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--prefill-len", type=int, default=131072)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_out_argument(parser, "bench_generation", dest="out_dir")
    parser.add_argument("--smoke", action="store_true", help="tiny model and sizes: a CPU plumbing check")
    args = parser.parse_intermixed_args(argv)
    args.model = args.model or ["model=gpt2-small"]
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)

    from model.attention import resolve_attention
    from training.device import resolve_device

    device = resolve_device(args.device)
    if device.type != "cuda" and not args.smoke:
        raise ValueError("no CUDA device: real generation figures need a GPU; use --smoke for a CPU plumbing check")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attentions = [resolve_attention(a, device) for a in args.attentions]   # bad names refused up front
    path = args.out_dir / f"generation_{device_slug(device)}"
    result = {"model": None, "dtype": str(dtype).removeprefix("torch."), "decode_steps": args.decode_steps,
              "warmup_steps": args.warmup_steps, "decode": [], "prefill": [], "environment": environment(device)}
    for attention in attentions:
        model, model_cfg = build(args.model, attention, device, dtype)
        result["model"] = model_cfg.name
        for prompt_len in args.prompt_lens:
            for batch in args.batch_sizes:
                row = measure(decode_case, device, model, batch, prompt_len, args.decode_steps, args.warmup_steps)
                result["decode"].append({"attention": attention, "batch": batch, "prompt_len": prompt_len, **row})
                write_results(path, result)
        row = measure(prefill_case, device, model, args.prefill_len, args.prefill_repeats)
        result["prefill"].append({"attention": attention, "prompt_len": args.prefill_len, **row})
        write_results(path, result)
        del model
    print_table(f"decoding, {result['model']}", ["attention", "batch", "prompt", "tokens/s"],
                [(r["attention"], r["batch"], r["prompt_len"], r.get("error") or f"{r['tokens_per_s']:,.0f}")
                 for r in result["decode"]])
    print_table(f"prefill, {result['model']}", ["attention", "prompt", "seconds"],
                [(r["attention"], r["prompt_len"], r.get("error") or f"{r['prefill_s']:.3f}") for r in result["prefill"]])
    return result


if __name__ == "__main__":
    run_cli(main)
