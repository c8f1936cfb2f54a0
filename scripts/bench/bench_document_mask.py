"""Packed documents and sliding windows: our masked kernel against FlexAttention and plain causal.

    python scripts/bench/bench_document_mask.py           # H200: 64K windows, about 3 minutes (most of
                                                    # it compiling FlexAttention for each mask)
    python scripts/bench/bench_document_mask.py --cases window-4k   # one case; the file keeps the others
    python scripts/bench/bench_document_mask.py --smoke   # CPU-sized plumbing check (not a benchmark)
    python scripts/bench/bench_document_mask.py --kernel triton/gluon --length 16384 --cases docs-mixed
                                                    # ours with a kernel word: here the Gluon backward

Cases, one sequence (B = 1) of T = 64K tokens, bf16, causal, 12 heads of 64 by default (--heads):

- docs-2k: documents of exactly 2,048 tokens (32 per window);
- docs-mixed: a realistic mix, lengths drawn log-normally (median ~700, mean ~2K tokens, from
  16 tokens to the whole window; fixed seed), the way web text and code files are distributed;
- window-4k: no documents, each query sees its last 4,096 keys (Mistral's sliding window).

Each case times, with triton.testing.do_bench (median, L2 flushed), forward and forward+backward of
ours with the mask, FlexAttention (torch.compile'd) with the same mask as its block mask (128 x 128
blocks, built with create_block_mask), and ours with plain causal attention over the whole window
(what the model computes without the mask). "Speed-up vs causal" is causal's time over the masked
one; "vs Flex" is Flex's time over ours. TFLOP/s count only the visible score pairs:
forward 4 * H * D * pairs, forward+backward 3.5x that. What each side builds from the mask is
timed apart too ("mask build ms"): ours turns the document ids into per-token bounds inside every
call (kernels.masks.bounds_buffer), so its times include that; Flex's block mask is built once,
before its calls are timed, as a model builds it once a step. Results: <out>/document_mask_<gpu>.json
(with date, GPU, versions, commit) and .md, rewritten after each case.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import (add_out_argument, console, device_slug, environment, error_text, kernel_bench_device, kernel_timer,
                     markdown_table, print_table, run_cli, tuning_note, write_json, write_text)

CASES = ("docs-2k", "docs-mixed", "window-4k")
HEADERS = ["case", "T", "docs", "window", "pass", "ours masked ms", "Flex ms", "ours causal ms",
           "vs Flex", "vs causal", "ours TFLOP/s", "mask build ms: ours (in its calls) / Flex (before them)"]


def mixed_lengths(total: int, seed: int = 0, median: float = 700.0, sigma: float = 1.5) -> list[int]:
    """Document lengths filling `total` tokens: log-normal (median 700, mean ~2.1K), 16..total,
    the last one cut to fit, as a packing sampler's window cuts it. Windows shorter than 64K
    (--length, --smoke) scale the median with them."""
    median = max(16.0, median * total / 65536)
    g = torch.Generator().manual_seed(seed)
    out, used = [], 0
    while used < total:
        n = int(torch.empty(1).log_normal_(mean=float(torch.tensor(median).log()), std=sigma, generator=g))
        n = max(16, min(n, total - used))
        out.append(n)
        used += n
    return out


def doc_ids(doc_lengths: list[int], device) -> torch.Tensor:
    lengths = torch.tensor(doc_lengths)
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None].to(device, torch.int32)


def visible_pairs(T: int, doc_lengths: list[int] | None, window: int | None) -> int:
    """Query-key pairs a causal query sees (the work that is not skipped, before tiling)."""
    if doc_lengths is None:
        doc_lengths = [T]
    w = window or T
    return sum(sum(min(i + 1, w) for i in range(n)) if w < n else n * (n + 1) // 2 for n in doc_lengths)


def make_case(name: str, T: int, device) -> dict:
    if name == "docs-2k":
        lengths, window = [2048] * (T // 2048) + ([T % 2048] if T % 2048 else []), None
    elif name == "docs-mixed":
        lengths, window = mixed_lengths(T), None
    elif name == "window-4k":
        lengths, window = None, min(4096, T // 4)
    else:
        raise ValueError(f"unknown case {name!r}")
    return {"name": name, "T": T, "lengths": lengths, "window": window,
            "ids": None if lengths is None else doc_ids(lengths, device)}


def ours(case: dict, masked: bool, kernel="auto"):
    """Our attention under `kernel` (a word or a (forward, backward) pair: kernels.flash_attention's)."""
    from kernels import flash_attention
    if not masked:
        return lambda q, k, v: flash_attention(q, k, v, causal=True, kernel=kernel)
    return lambda q, k, v: flash_attention(q, k, v, causal=True, document_ids=case["ids"], window=case["window"],
                                           kernel=kernel)


def flex_block_mask(case: dict, device):
    """A builder of the case's mask as FlexAttention's block mask (128 x 128 blocks): one mask_mod,
    so that building again reuses its compiled graph."""
    if device.type != "cuda":
        raise RuntimeError("FlexAttention is timed on CUDA only (CPU smoke run)")
    from torch.nn.attention.flex_attention import create_block_mask

    ids, window = case["ids"], case["window"]

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if ids is not None:
            keep = keep & (ids[0, q_idx] == ids[0, kv_idx])
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    return lambda: create_block_mask(mask_mod, None, None, case["T"], case["T"], device=device, _compile=True)


def flex(case: dict, device):
    """FlexAttention with the same mask as a block mask; (B, N, H, D) in and out like ours."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    build = flex_block_mask(case, device)
    torch._dynamo.reset()
    block_mask = build()
    compiled = torch.compile(flex_attention, dynamic=False)

    def attention(q, k, v):
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                       enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
    return attention


def time_mask_build(case: dict, device, bench) -> dict:
    """Milliseconds to build each side's mask from the case (None: nothing to build, or not run)."""
    from kernels.masks import bounds_buffer

    built = {"ours": None, "flex": None}
    if case["ids"] is not None:
        built["ours"] = bench(lambda: bounds_buffer(case["ids"], None, case["T"]))
    if device.type == "cuda":
        try:
            built["flex"] = bench(flex_block_mask(case, device))
        except Exception as exc:  # Flex's own failure is its row's to report; the build is then not timed
            built["flex_error"] = error_text(exc)
    return built


def time_backend(make, heads, T, dtype, device, bench) -> dict:
    H, Hkv, D = heads
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, T, H, D, device=device, dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(1, T, Hkv, D, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(2))
    dout = torch.randn(1, T, H, D, device=device, dtype=dtype, generator=g)
    try:
        attention = make()
        with torch.no_grad():
            fwd = bench(lambda: attention(q, k, v))
        both = bench(lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), dout))
        return {"fwd": fwd, "fwd+bwd": both, "status": "ok"}
    except Exception as exc:  # one failing backend is recorded, the others still run
        return {"status": f"error: {error_text(exc)}"}


def rows(report: dict) -> list[list]:
    table = []
    for r in report["results"]:
        for p in ("fwd", "fwd+bwd"):
            m, f, c = (r[b].get(p) for b in ("ours", "flex", "causal"))
            fmt = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
            flops = 4 * r["H"] * r["D"] * r["visible_pairs"] * (3.5 if p == "fwd+bwd" else 1)
            built = r.get("mask_build", {})
            table.append([r["case"], r["T"], r["documents"] or "-", r["window"] or "-", p, fmt(m), fmt(f), fmt(c),
                          f"{f / m:.2f}x" if m and f else "-", f"{c / m:.1f}x" if m and c else "-",
                          f"{flops / m / 1e9:.0f}" if m else "-",
                          " / ".join(f"{x:.3f}" if x is not None else "-" for x in (built.get("ours"), built.get("flex")))
                          if built else "-"])
    return table


def earlier_rows(path: Path, report: dict, rerun: list[str]) -> list[dict]:
    """Rows of the cases not rerun, from an earlier results file of the same shapes (heads, T, dtype),
    so one case can be measured on its own without losing the others."""
    if not path.is_file():
        return []
    import json
    old = json.loads(path.read_text())
    if (old.get("heads"), old.get("dtype")) != (report["heads"], report["dtype"]):
        return []
    meta = old.get("metadata", {})
    return [dict(r, measured=r.get("measured", {"date": meta.get("date"), "commit": meta.get("git_commit")}))
            for r in old.get("results", []) if r["case"] not in rerun and r["T"] == report["T"]]


def write_outputs(stem: Path, report: dict) -> None:
    report["results"].sort(key=lambda r: CASES.index(r["case"]))
    write_json(stem.with_suffix(".json"), report)
    meta = report["metadata"]
    older = sorted({f"{r['case']} (commit {r['measured']['commit']}, {r['measured']['date']})"
                    for r in report["results"] if r["measured"]["commit"] != meta["git_commit"]})
    failed = [f"- {r['case']} {b}: {r[b]['status']}" for r in report["results"] for b in ("ours", "flex", "causal")
              if r[b]["status"] != "ok"]
    text = (f"# Document masks and sliding windows ({meta['device']})\n\n"
            f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['git_commit']}, "
            f"`{meta['command']}`. Ours under kernel={report.get('kernel', 'auto')}. Heads (H/Hkv/D) {report['heads']}, "
            f"{report['dtype']}, B = 1, causal; timing: "
            f"{report['timing']}.{tuning_note(meta)}"
            + (f" Rows measured by an earlier run: {'; '.join(older)}." if older else "") + "\n\n"
            + markdown_table(HEADERS, rows(report)) + "\n"
            + ("\nNot measured:\n" + "\n".join(failed) + "\n" if failed else ""))
    write_text(stem.with_suffix(".md"), text)


def main(argv: list[str] | None = None) -> dict:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="CPU-sized shapes that only check the plumbing")
    parser.add_argument("--length", type=int, default=65536, help="tokens per window (default 65536)")
    parser.add_argument("--heads", default="12/12/64", help="H/Hkv/D (default 12/12/64, gpt2-small)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated subset of {','.join(CASES)} (default all); the results file keeps "
                             "the other cases' rows of an earlier run of the same shapes")
    parser.add_argument("--kernel", default="auto",
                        help="ours under this kernel word (auto, triton, gluon) or forward/backward pair (triton/gluon); "
                             "other than auto, the results file is named for it")
    add_out_argument(parser, "bench_document_mask")
    args = parser.parse_args(argv)
    kernel = tuple(args.kernel.split("/")) if "/" in args.kernel else args.kernel
    try:
        heads = tuple(int(x) for x in args.heads.split("/"))
    except ValueError:
        raise ValueError(f"--heads={args.heads!r}: expected H/Hkv/D integers") from None
    if len(heads) != 3 or min(heads) < 1 or heads[0] % heads[1]:
        raise ValueError(f"--heads={args.heads!r}: H/Hkv/D, positive, H a multiple of Hkv")
    cases = [c for c in args.cases.split(",") if c]
    if not cases or any(c not in CASES for c in cases):
        raise ValueError(f"--cases={args.cases!r}: expected a comma-separated subset of {','.join(CASES)}")
    if args.length < 64:
        raise ValueError(f"--length={args.length}: at least 64 tokens")
    device = kernel_bench_device(args.smoke)
    T = 128 if args.smoke else args.length
    if args.smoke:
        heads = (2, 1, 16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bench, timing = kernel_timer(device, cpu_calls=1)
    out = console()
    word = "" if args.kernel == "auto" else "_" + args.kernel.replace("/", "-")
    stem = args.out / f"document_mask_{device_slug(device)}{word}"
    report = {"metadata": environment(device), "heads": "/".join(map(str, heads)), "results": [], "kernel": args.kernel,
              "dtype": str(dtype).replace("torch.", ""), "T": T,
              "timing": timing}
    report["results"] = earlier_rows(stem.with_suffix(".json"), report, cases)
    measured = {"date": report["metadata"]["date"], "commit": report["metadata"]["git_commit"]}
    causal = time_backend(lambda: ours(None, False, kernel), heads, T, dtype, device, bench)
    for name in cases:
        case = make_case(name, T, device)
        if args.smoke and name == "docs-2k":  # 2K documents do not fit: documents of 32
            case = dict(case, lengths=[32] * (T // 32), ids=doc_ids([32] * (T // 32), device))
        row = {"case": name, "T": T, "H": heads[0], "D": heads[2], "window": case["window"],
               "documents": None if case["lengths"] is None else len(case["lengths"]),
               "mean_doc_len": None if case["lengths"] is None else T / len(case["lengths"]),
               "visible_pairs": visible_pairs(T, case["lengths"], case["window"]),
               "ours": time_backend(lambda: ours(case, True, kernel), heads, T, dtype, device, bench),
               "flex": time_backend(lambda: flex(case, device), heads, T, dtype, device, bench),
               "causal": causal, "mask_build": time_mask_build(case, device, bench), "measured": measured}
        report["results"].append(row)
        out.print(f"{name}: ours {row['ours']}, flex {row['flex']}")
        write_outputs(stem, report)
    print_table(f"Document masks and windows, {report['metadata']['device']}", HEADERS, rows(report))
    out.print(f"wrote {stem}.json, .md")
    return report


if __name__ == "__main__":
    run_cli(main)
