"""How far each backward's gradients are from float64 on a long training window: a diagnosis.

    python scripts/kernel_dev/backward_error.py --out DIR

The tests hold a kernel to 2x the same-dtype formula's error, a bound for "exact": bf16's plain
formula is ~1% off, so two kernels that both pass may still differ tenfold in their own error,
or one may be biased where the other is not. This prints, for the Triton backward and (on sm_90)
the Gluon one, side by side on the same inputs and the same forward (Triton's), each gradient's
error against float64:

- rel err: |mine - exact| / |exact| (Frobenius), beside the bf16 formula's ("plain");
- gain: <mine, exact> / <exact, exact> - 1, a systematic scale error (a gradient shrunk at long
  range would train retrieval slowly and show here first, as a sign the norm hides);
- repeat: whether a second call on the same input gives the same bits (a changing result is a race).

over the regions a long-context run leans on: each document of a 32K window (the test's layout,
64 to 16,384 tokens), the 16K document's first 1,024 keys (dK, dV), and, in the "needle" inputs,
256 queries at the end of the 16K document that each copy one of its first 256 keys (q = 2 k: P
near 1 on a key 16K back, the attention a passkey answer needs), with their dQ and those keys'
dK and dV apart. "flat" inputs are the tests' N(0, 1) q, k, v. Writes DIR/backward_error_<gpu>.json
and .md. Needs CUDA; the float64 reference of the 16K document takes ~20 GB.

    python scripts/kernel_dev/backward_error.py --checkpoint RUN --out DIR

does the same with a trained model's own attention inputs: one forward and backward of the run's
model on its first training window (--window val: its first held-out one), with the run's masks,
records every layer's q, k, v and dO, and measures both backwards on each layer over the whole
window and over its longest document's first 1,024 keys (dK, dV): the statistics of trained
weights (sharp heads, large logits) that N(0, 1) inputs lack. Writes
DIR/backward_error_<run>_<gpu>.{json,md}.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common
import _common  # noqa: E402  (puts the repo root on sys.path)
import torch  # noqa: E402
from _common import (add_out_argument, argument_parser, device_slug, environment, markdown_table,  # noqa: E402
                     run_cli, write_json, write_text)

from kernels import flash_attention  # noqa: E402
from kernels.checks import device_arch  # noqa: E402
from kernels.masks import document_bounds  # noqa: E402
from kernels.reference import attention_reference  # noqa: E402

DOCS = [64, 700, 16384, 9000, 6620]   # a 32,768-token window, as tests/test_document_mask.py's long case
LONG = 2                              # the 16K document
FAR, NEEDLES = 1024, 256
GRADS = ("dq", "dk", "dv")
DTYPE = torch.bfloat16


def inputs(kind: str, heads: int, seed: int, device):
    """q, k, v, do (1, 32768, heads, 64) bf16; 'needle': the 16K document's last NEEDLES queries copy its first keys."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, sum(DOCS), heads, 64, generator=g) for _ in range(4))
    if kind == "needle":
        start = sum(DOCS[:LONG])
        end = start + DOCS[LONG]
        q[:, end - NEEDLES:end] = 2 * k[:, start:start + NEEDLES]
    return [t.to(device, DTYPE) for t in (q, k, v, do)]


def grads(fn, q, k, v, do, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kw)
    return dict(zip(GRADS, torch.autograd.grad(out, (q, k, v), do)))


def both_backwards(device, q, k, v, do, **kw) -> tuple[dict, dict]:
    """{backward: its gradients} for the Triton backward and, on sm_90, the Gluon one (the forward
    Triton's for both), and {backward: whether a second call repeats them bit for bit}."""
    ours, repeat = {}, {}
    for b in ["triton"] + (["gluon"] if device_arch(device) == "sm_90" else []):
        ours[b], again = (grads(flash_attention, q, k, v, do, **kw, kernel=("triton", b)) for _ in range(2))
        repeat[b] = all(torch.equal(ours[b][g], again[g]) for g in GRADS)
    return ours, repeat


def sums(mine, plain, exact) -> torch.Tensor:
    """|mine - exact|^2, |plain - exact|^2, <mine, exact>, |exact|^2: what `stats` needs, summable
    over the pieces of one region (documents, head groups)."""
    exact = exact.double()
    mine, plain = mine.double(), plain.double()
    return torch.stack([((mine - exact) ** 2).sum(), ((plain - exact) ** 2).sum(), (mine * exact).sum(),
                        (exact * exact).sum()]).cpu()


def stats(total: torch.Tensor) -> dict:
    """rel err, the bf16 formula's rel err and the gain from a region's `sums`."""
    d2, p2, me, e2 = total.tolist()
    return dict(rel_err=(d2 / e2) ** 0.5, plain_rel_err=(p2 / e2) ** 0.5, gain=me / e2 - 1)


def regions(kind: str):
    """(name, document index, grads, rows within the document or None for all of it)."""
    for i, n in enumerate(DOCS):
        yield f"document {i} ({n} tokens)", i, GRADS, None
    yield f"first {FAR} keys of the {DOCS[LONG]}-token document", LONG, ("dk", "dv"), slice(0, FAR)
    if kind == "needle":
        yield f"the {NEEDLES} copying queries", LONG, ("dq",), slice(DOCS[LONG] - NEEDLES, DOCS[LONG])
        yield f"the {NEEDLES} keys they copy", LONG, ("dk", "dv"), slice(0, NEEDLES)


def measure(device, heads: int, seed: int) -> list[dict]:
    """One row per (inputs, region, gradient, backward)."""
    ids = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))[None].to(device, torch.int32)
    starts = [sum(DOCS[:i]) for i in range(len(DOCS))]
    rows = []
    for kind in ("flat", "needle"):
        q, k, v, do = inputs(kind, heads, seed, device)
        ours, repeat = both_backwards(device, q, k, v, do, causal=True, document_ids=ids)
        for i, n in enumerate(DOCS):       # one float64 causal call per document: they do not see one another
            part = [t[:, starts[i]:starts[i] + n] for t in (q, k, v, do)]
            exact = grads(attention_reference, *(t.double() for t in part), causal=True)
            plain = grads(attention_reference, *part, causal=True)
            for name, doc, which, sub in regions(kind):
                if doc != i:
                    continue
                sub = sub or slice(0, n)
                for g in which:
                    for b in ours:
                        mine = ours[b][g][:, starts[i]:starts[i] + n][:, sub]
                        rows.append(dict(inputs=kind, region=name, grad=g, backward=b, repeat_identical=repeat[b],
                                         **stats(sums(mine, plain[g][:, sub], exact[g][:, sub]))))
            del exact, plain
            torch.cuda.empty_cache()
        print(f"{kind}: done", flush=True)
    return rows


MASKS = {"causal", "document_ids", "window", "softcap"}   # what the float64 reference takes as the kernels do


def recorded_attention(model, x, y, document_ids, precision) -> list[dict]:
    """Every layer's attention call in one forward and backward of `model` on (x, y): its q, k, v,
    keywords and the gradient dO of its output. A layer recomputed in backward (activation
    checkpointing) records again with equal inputs; its dO comes from that second call."""
    from training.process.device import autocast

    calls = [dict() for _ in model.blocks]
    inner = [block.attn.attention for block in model.blocks]

    def recorder(layer):
        def attention(q, k, v, **kw):
            if set(kw) - MASKS:
                raise ValueError(f"layer {layer} calls attention with {sorted(set(kw) - MASKS)}: this diagnosis "
                                 f"compares against a float64 reference that takes only {sorted(MASKS)}")
            out = inner[layer](q, k, v, **kw)
            call = calls[layer]
            call.update(q=q.detach().clone(), k=k.detach().clone(), v=v.detach().clone(), kw=kw)
            out.register_hook(lambda g: call.update(do=g.detach().clone()))
            return out
        return attention

    try:
        for layer, block in enumerate(model.blocks):
            block.attn.attention = recorder(layer)
        masks = {} if document_ids is None else {"document_ids": document_ids}
        with autocast(x.device, precision):
            loss = model(x, y, **masks)
        loss.backward()
    finally:
        for block, fn in zip(model.blocks, inner):
            block.attn.attention = fn
    return calls


def documents(document_ids, n: int) -> list[tuple[int, int]]:
    """(start, end) of each document of a (1, n) window (one document without ids): the distinct
    per-token bounds the kernels' own mask uses."""
    if document_ids is None:
        return [(0, n)]
    start, end = document_bounds(document_ids)[0].tolist()
    return sorted(set(zip(start, end)))


def measure_trained(calls: list[dict], device, budget: int = 2**27) -> list[dict]:
    """One row per (layer, region, gradient, backward): the whole window, and its longest
    document's first FAR keys (dK, dV). The float64 reference runs per document and per group of
    KV heads small enough that a score matrix stays under `budget` elements."""
    rows = []
    for layer, call in enumerate(calls):
        q, k, v, do, kw = call["q"], call["k"], call["v"], call["do"], dict(call["kw"])
        ids = kw.pop("document_ids", None)
        ours, repeat = both_backwards(device, q, k, v, do, **kw, document_ids=ids)
        spans = documents(ids, q.shape[1])
        longest = max(spans, key=lambda span: span[1] - span[0])
        far = slice(0, min(longest[1] - longest[0], FAR))   # its first keys, within the document
        group = q.shape[2] // k.shape[2]
        total = {(region, g, b): torch.zeros(4, dtype=torch.float64) for region in ("window", "far")
                 for g in GRADS for b in ours}
        for start, end in spans:
            n = end - start
            heads = max(1, min(k.shape[2], budget // (n * n * group)))
            for h in range(0, k.shape[2], heads):
                qh, kh = slice(h * group, (h + heads) * group), slice(h, h + heads)
                part = [q[:, start:end, qh], k[:, start:end, kh], v[:, start:end, kh], do[:, start:end, qh]]
                exact = grads(attention_reference, *(t.double() for t in part), **kw)
                plain = grads(attention_reference, *part, **kw)
                cut = {"dq": qh, "dk": kh, "dv": kh}
                for g in GRADS:
                    for b in ours:
                        mine = ours[b][g][:, start:end, cut[g]]
                        total["window", g, b] += sums(mine, plain[g], exact[g])
                        if (start, end) == longest and g != "dq":
                            total["far", g, b] += sums(mine[:, far], plain[g][:, far], exact[g][:, far])
                del exact, plain
        names = {"window": f"whole window ({len(spans)} documents)",
                 "far": f"first {far.stop:,} keys of its longest document ({longest[1] - longest[0]:,} tokens)"}
        for (region, g, b), t in total.items():
            if t[3] > 0:
                rows.append(dict(inputs=f"layer {layer}", region=names[region], grad=g, backward=b,
                                 repeat_identical=repeat[b], **stats(t)))
        print(f"layer {layer}: done", flush=True)
    return rows


def trained_inputs(args, device):
    """The run's model and one window of its data (--window), with its document ids where the run
    masked documents: (model, x, y, document_ids, precision, run name)."""
    from _eval import load_for_eval, run_name
    from training.builders import build_data

    args.attention = "flash"
    model, cfg, _, device, path = load_for_eval(args)
    seq_len = int(cfg.trainer.seq_len)
    mask = bool(cfg.data.get("document_mask", False))
    bundle = build_data(cfg, seq_len=seq_len, seed=cfg.seed)
    x, y, *ids = (bundle.train.next_batch(1, return_doc_ids=mask) if args.window == "train"
                  else bundle.val_batches(1, 1, return_doc_ids=mask)[0])
    ids = ids[0].to(device, torch.int32) if ids else None
    return model, x.to(device), y.to(device), ids, cfg.trainer.precision, run_name(args, path)


def main(argv: list[str]) -> None:
    parser = argument_parser(__doc__)
    add_out_argument(parser, "backward_error")
    parser.add_argument("--seed", type=int, default=0, help="the inputs' seed")
    parser.add_argument("--heads", type=int, default=2, help="query (and key) heads")
    parser.add_argument("--checkpoint", type=_common.existing_path, default=None,
                        help="a run dir or checkpoint: its model's own attention inputs instead of random ones")
    parser.add_argument("--window", choices=["train", "val"], default="train",
                        help="with --checkpoint: the run's first training window, or its first held-out one")
    parser.add_argument("--name", type=_common.file_stem, default=None, help="with --checkpoint: the run's name in the output")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise ValueError("this diagnosis runs our CUDA kernels against float64: it needs a GPU")
    device = torch.device("cuda")
    if args.checkpoint is None:
        rows, stem, what = measure(device, args.heads, args.seed), "backward_error", (
            f"Documents {DOCS}, {args.heads} heads of 64, bf16, causal, inputs' seed {args.seed}")
        extra = dict(docs=DOCS, seed=args.seed, heads=args.heads)
    else:
        args.device = "cuda"
        model, x, y, ids, precision, name = trained_inputs(args, device)
        rows = measure_trained(recorded_attention(model, x, y, ids, precision), device)
        stem, what = f"backward_error_{name}", (f"{name}'s attention inputs and dO on its first {args.window} window "
                                                f"({x.shape[1]:,} tokens), {precision}")
        extra = dict(checkpoint=str(args.checkpoint), window=args.window)
    meta = environment(device)
    stem = args.out / f"{stem}_{device_slug(device)}"
    write_json(stem.with_suffix(".json"), dict(environment=meta, **extra, results=rows))
    table = markdown_table(["inputs", "region", "grad", "backward", "rel err", "plain's rel err", "gain", "repeat"],
                           [[r["inputs"], r["region"], r["grad"], r["backward"], f"{r['rel_err']:.2e}",
                             f"{r['plain_rel_err']:.2e}", f"{r['gain']:+.2e}", "same" if r["repeat_identical"] else "DIFFERS"]
                            for r in rows])
    text = (f"# Each backward's error against float64\n\n{meta['date']}, {meta['device']}, "
            f"torch {meta['torch']}, triton {meta['triton']}, commit {meta['git_commit']}, `{meta['command']}`. "
            f"{what}; forward: Triton's.\n\n{table}\n")
    write_text(stem.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    run_cli(main)
