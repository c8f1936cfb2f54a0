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
    out = fn(q, k, v, causal=True, **kw)
    return dict(zip(GRADS, torch.autograd.grad(out, (q, k, v), do)))


def stats(mine, plain, exact) -> dict:
    diff = mine.double() - exact
    norm2 = (exact * exact).sum()
    return dict(rel_err=(diff.norm() / norm2.sqrt()).item(),
                plain_rel_err=((plain.double() - exact).norm() / norm2.sqrt()).item(),
                gain=((mine.double() * exact).sum() / norm2 - 1).item())


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
    backwards = ["triton"] + (["gluon"] if device_arch(device) == "sm_90" else [])
    ids = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))[None].to(device, torch.int32)
    starts = [sum(DOCS[:i]) for i in range(len(DOCS))]
    rows = []
    for kind in ("flat", "needle"):
        q, k, v, do = inputs(kind, heads, seed, device)
        ours, repeat = {}, {}
        for b in backwards:
            ours[b], again = (grads(flash_attention, q, k, v, do, document_ids=ids, kernel=("triton", b))
                              for _ in range(2))
            repeat[b] = all(torch.equal(ours[b][g], again[g]) for g in GRADS)
        for i, n in enumerate(DOCS):       # one float64 causal call per document: they do not see one another
            part = [t[:, starts[i]:starts[i] + n] for t in (q, k, v, do)]
            exact = grads(attention_reference, *(t.double() for t in part))
            plain = grads(attention_reference, *part)
            for name, doc, which, sub in regions(kind):
                if doc != i:
                    continue
                sub = sub or slice(0, n)
                for g in which:
                    for b in backwards:
                        mine = ours[b][g][:, starts[i]:starts[i] + n][:, sub]
                        rows.append(dict(inputs=kind, region=name, grad=g, backward=b, repeat_identical=repeat[b],
                                         **stats(mine, plain[g][:, sub], exact[g][:, sub])))
            del exact, plain
            torch.cuda.empty_cache()
        print(f"{kind}: done", flush=True)
    return rows


def main(argv: list[str]) -> None:
    parser = argument_parser(__doc__)
    add_out_argument(parser, "backward_error")
    parser.add_argument("--seed", type=int, default=0, help="the inputs' seed")
    parser.add_argument("--heads", type=int, default=2, help="query (and key) heads")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise ValueError("this diagnosis runs our CUDA kernels against float64: it needs a GPU")
    device = torch.device("cuda")
    rows = measure(device, args.heads, args.seed)
    meta = environment(device)
    stem = args.out / f"backward_error_{device_slug(device)}"
    write_json(stem.with_suffix(".json"), dict(environment=meta, docs=DOCS, seed=args.seed, heads=args.heads,
                                               results=rows))
    table = markdown_table(["inputs", "region", "grad", "backward", "rel err", "plain's rel err", "gain", "repeat"],
                           [[r["inputs"], r["region"], r["grad"], r["backward"], f"{r['rel_err']:.2e}",
                             f"{r['plain_rel_err']:.2e}", f"{r['gain']:+.2e}", "same" if r["repeat_identical"] else "DIFFERS"]
                            for r in rows])
    text = (f"# Each backward's error against float64 on a 32K window of documents\n\n{meta['date']}, {meta['device']}, "
            f"torch {meta['torch']}, triton {meta['triton']}, commit {meta['git_commit']}, `{meta['command']}`. "
            f"Documents {DOCS}, {args.heads} heads of 64, bf16, causal, inputs' seed {args.seed}; forward: Triton's.\n\n"
            f"{table}\n")
    write_text(stem.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    run_cli(main)
