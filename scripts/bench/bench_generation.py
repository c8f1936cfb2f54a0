"""Generation speed: decoding tokens/s by decode mode (eager, static cache, CUDA graph) and prefill.

    python scripts/bench/bench_generation.py                 # GPU: gpt2-small, bf16 weights, random tokens
    python scripts/bench/bench_generation.py --attention flash model=gpt-1b    # one implementation, another model
    python scripts/bench/bench_generation.py --smoke         # CPU-sized plumbing check (not a benchmark)

Decoding: a batch of B random prompts of N tokens is prefilled into the cache, then greedy
decoding runs --warmup-steps untimed steps and --decode-steps timed ones through
model.generation's `decode` (the path scripts/generate.py uses) in each --modes entry:
`eager` (a growing KV cache, every kernel launched from Python), `static` (a static KV cache:
fixed shapes, the attention's decode entry over the whole buffer) and `graph` (the static step
captured once as a CUDA graph and replayed; CUDA only, left out elsewhere with a note).
tokens/s = B * decode steps / seconds. Each case runs twice and the second is kept, so kernel
compilation, autotuning and graph capture are not timed. Every mode decodes the same prompts, and
the greedy tokens are compared: `graph` must equal `static` exactly (the same kernels), and both
are compared with `eager` (whose attention sums in another order). Prefill: one prompt of
--prefill-len tokens through the cache (last position's logits only), median of
--prefill-repeats after a warm-up. Random weights: speed does not depend on their values.
Cases run smallest first with every implementation and mode side by side, and prefill last, so a
run cut short still compares them. Writes <out>/generation_<device>.{json,md} (--out: default
outputs/bench_generation/, committed results with --out benchmarks/generation), rewritten after
every measurement.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import (add_out_argument, argument_parser, attention_list, device_slug, environment, error_text,
                     markdown_table, print_table, run_cli, runnable_attentions, tuning_note, write_json, write_text)
from _memory import release_memory

SMOKE = dict(model=["model=tiny", "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2"],
             batch_sizes=[1, 2], prompt_lens=[64, 128], prefill_len=256, decode_steps=4, warmup_steps=1,
             prefill_repeats=2)
BASELINE = "eager"   # the mode the others' tokens are compared with


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_case(model, prompt: torch.Tensor, steps: int, warmup: int, mode: str, device) -> dict:
    """Seconds of the prefill and of `steps` decode steps after `warmup` untimed ones; the tokens."""
    from model.generation import Sampling, decode

    batch = prompt.shape[0]
    sync(device)
    marks, chosen = [time.perf_counter()], []
    for i, (_, tokens) in enumerate(decode(model, prompt, 1 + warmup + steps, Sampling(temperature=0), mode=mode)):
        chosen.append(tokens)
        if i in (0, warmup, warmup + steps):
            sync(device)
            marks.append(time.perf_counter())
    prefill_s, decode_s = marks[1] - marks[0], marks[3] - marks[2]
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": steps,
            "tokens_per_s": batch * steps / decode_s, "ms_per_step": 1e3 * decode_s / steps,
            "tokens": torch.stack(chosen, 1).cpu()}


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
    release_memory(device)   # the previous case's cache, and its peak, out of this one's numbers
    try:
        fn(*args, device)                                  # warm-up: compile, autotune, capture
        result = fn(*args, device)
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as exc:
        return {"error": error_text(exc)}
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


VOCAB = 50257   # GPT-2's tokenizer: the random prompts' ids, the model's head sized from it as training would


def build(model_overrides: list[str], attention: str, device, dtype):
    from training.builders import build_model
    from training.config import compose

    cfg = compose(model_overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab_size=VOCAB, attention=attention)
    return model.to(device=device, dtype=dtype).eval(), cfg.model


def compare_tokens(rows: list[dict], tokens: dict) -> None:
    """Fill each decode row's `same_tokens_as_<mode>`: the share of its greedy tokens equal to the
    baseline mode's and, for graph, to static's, on the same prompts (1.0: identical)."""
    for row in rows:
        key = (row["attention"], row["batch"], row["prompt_len"])
        mine = tokens.get(key + (row["mode"],))
        for other in (BASELINE, "static"):
            theirs = tokens.get(key + (other,))
            if other != row["mode"] and mine is not None and theirs is not None and (other == BASELINE or row["mode"] == "graph"):
                row[f"same_tokens_as_{other}"] = (mine == theirs).float().mean().item()


def speedups(rows: list[dict]) -> list[str]:
    """Sentences for the header: each mode against the same attention's eager decoding, and ours
    against SDPA, at batch 1."""
    by = {(r["attention"], r["mode"], r["batch"], r["prompt_len"]): r for r in rows if "error" not in r}
    lines = []
    for (attention, mode, batch, n), r in by.items():
        eager = by.get((attention, BASELINE, batch, n))
        sdpa = by.get(("sdpa", mode, batch, n))
        if batch != 1 or mode == BASELINE or eager is None:
            continue
        vs_sdpa = f", {r['tokens_per_s'] / sdpa['tokens_per_s']:.2f}x sdpa's {mode}" if sdpa and attention != "sdpa" else ""
        lines.append(f"- {attention}, {mode}, {n:,}-token prompt: {r['tokens_per_s']:,.0f} tokens/s, "
                     f"{r['tokens_per_s'] / eager['tokens_per_s']:.1f}x its eager {eager['tokens_per_s']:,.0f}{vs_sdpa}")
    return lines


def same_cell(r: dict, other: str) -> str:
    share = r.get(f"same_tokens_as_{other}")
    return "-" if share is None else "yes" if share == 1.0 else f"{share:.0%}"


def write_results(path: Path, result: dict) -> None:
    write_json(path.with_suffix(".json"), result)
    meta = result["environment"]
    dec_rows = [(r["attention"], r["mode"], r["batch"], f"{r['prompt_len']:,}",
                 r.get("error") or f"{r['tokens_per_s']:,.0f}", "-" if "error" in r else f"{r['ms_per_step']:.2f}",
                 "-" if "error" in r else f"{r['prefill_s']:.3f}", same_cell(r, BASELINE), same_cell(r, "static"))
                for r in result["decode"]]
    pre_rows = [(r["attention"], f"{r['prompt_len']:,}", r.get("error") or f"{r['prefill_s']:.3f}",
                 "-" if "error" in r else f"{r['tokens_per_s']:,.0f}") for r in result["prefill"]]
    notes = "".join(f" {n}" for n in result["notes"])
    summary = "\n".join(speedups(result["decode"]))
    text = (f"# Generation speed, {result['model']} ({meta['device']})\n\n"
            f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['git_commit']}, "
            f"weights in {result['dtype']}, random weights and prompts, greedy decoding through the KV cache. "
            "Modes: eager (growing cache, kernels launched one by one), static (static cache, fixed-shape "
            "steps), graph (the static step replayed from a CUDA graph). 'same as eager' / 'same as static': "
            "the share of greedy tokens equal to that mode's on the same prompts."
            f"{tuning_note(meta)}{notes} Command: `{meta['command']}`.\n\n"
            + (f"At batch 1:\n\n{summary}\n\n" if summary else "")
            + f"## Decoding ({result['decode_steps']} timed steps after {result['warmup_steps']} untimed)\n\n"
            + markdown_table(["attention", "mode", "batch", "prompt", "tokens/s", "ms/step", "prefill s",
                              "same as eager", "same as static"], dec_rows)
            + "\n## Prefill of one prompt (last position's logits only)\n\n"
            + markdown_table(["attention", "prompt", "seconds", "tokens/s"], pre_rows))
    write_text(path.with_suffix(".md"), text)


def main(argv: list[str]) -> dict:
    from model.generation import MODES

    parser = argument_parser(__doc__)
    parser.add_argument("model", nargs="*", metavar="key=value",
                        help="train.py's overrides for the model (default: model=gpt2-small)")
    parser.add_argument("--attention", dest="attentions", type=attention_list, default=["flash", "sdpa"],
                        help="comma-separated attention implementations (default flash,sdpa)")
    parser.add_argument("--modes", type=lambda text: attention_list(text, "--modes"), default=list(MODES),
                        help=f"comma-separated decode modes (default {','.join(MODES)})")
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
    if args.smoke:   # smaller defaults: what the user gave is kept, and checked below
        parser.set_defaults(**SMOKE)
        args = parser.parse_intermixed_args(argv)
    args.model = args.model or ["model=gpt2-small"]
    _common.require_positive(args, "batch_sizes", "prompt_lens", "prefill_len", "decode_steps", "prefill_repeats")
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps {args.warmup_steps}: must be 0 or more")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes: {unknown[0]!r} is not a decode mode; valid: {', '.join(MODES)}")

    from training.process.device import resolve_device

    device = resolve_device(args.device)
    if device.type != "cuda" and not args.smoke:
        raise ValueError("no CUDA device: real generation figures need a GPU; use --smoke for a CPU plumbing check")
    out = _common.console()
    notes: list[str] = []
    attentions = runnable_attentions(args.attentions, device, notes)
    modes = list(args.modes)
    if "graph" in modes and device.type != "cuda":
        modes.remove("graph")
        notes.append("graph mode left out: CUDA graphs need a GPU.")
    for note in notes:
        out.print(f"[yellow]{note}[/]")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = args.out_dir / f"generation_{device_slug(device)}"
    result = {"model": None, "dtype": str(dtype).removeprefix("torch."), "decode_steps": args.decode_steps,
              "warmup_steps": args.warmup_steps, "modes": modes, "notes": notes, "decode": [], "prefill": [],
              "environment": environment(device)}
    tokens: dict[tuple, torch.Tensor] = {}
    models = {attention: build(args.model, attention, device, dtype) for attention in attentions}   # the same weights
    result["model"] = next(iter(models.values()))[1].name
    for prompt_len in args.prompt_lens:   # the smallest cases first, every implementation and mode side by side
        for batch in args.batch_sizes:
            g = torch.Generator().manual_seed(prompt_len * 1000 + batch)   # the same prompts in every mode
            prompt = torch.randint(0, VOCAB, (batch, prompt_len), generator=g).to(device)
            for attention, (model, _) in models.items():
                for mode in modes:
                    row = measure(decode_case, device, model, prompt, args.decode_steps, args.warmup_steps, mode)
                    if "tokens" in row:
                        tokens[(attention, batch, prompt_len, mode)] = row.pop("tokens")
                    result["decode"].append({"attention": attention, "mode": mode, "batch": batch,
                                             "prompt_len": prompt_len, **row})
                    compare_tokens(result["decode"], tokens)
                    write_results(path, result)
    for attention, (model, _) in models.items():
        row = measure(prefill_case, device, model, args.prefill_len, args.prefill_repeats)
        result["prefill"].append({"attention": attention, "prompt_len": args.prefill_len, **row})
        write_results(path, result)
    print_table(f"decoding, {result['model']}", ["attention", "mode", "batch", "prompt", "tokens/s", "same as eager"],
                [(r["attention"], r["mode"], r["batch"], r["prompt_len"], r.get("error") or f"{r['tokens_per_s']:,.0f}",
                  same_cell(r, BASELINE)) for r in result["decode"]])
    print_table(f"prefill, {result['model']}", ["attention", "prompt", "seconds"],
                [(r["attention"], r["prompt_len"], r.get("error") or f"{r['prefill_s']:.3f}") for r in result["prefill"]])
    out.print(f"wrote {path}.json, .md")
    return result


if __name__ == "__main__":
    run_cli(main)
