"""Document masks and sliding windows: the argument checks, the kernel's pre-pass, the dense oracle.

Which keys a query may see is, for every mask this project supports, one interval per
query row. With documents given as per-token ids (B, N) of a packed window, a *document*
is a maximal run of equal ids (so a sampler's nondecreasing ids and any other labelling
of contiguous documents mean the same thing), and query i sees

    keys [doc_start(i), doc_end(i))       documents
    ∩ keys <= i + (Nk - Nq)               causal, aligned bottom-right
    ∩ keys >  i + (Nk - Nq) - window      sliding window (Mistral's causal local attention)

`document_bounds` turns the ids into the two per-token ends on the device (cheap torch ops,
traceable by torch.compile, no host sync), once for all the layers that pass the same ids. The
kernels read them to skip whole tiles and to mask the partial ones (kernels/tiles.py).
`visible_mask` builds the same mask densely, from run ids rather than from those bounds, for the
reference and SDPA.

`key_bounds` (B, 2, Nq) states the interval of every query directly, in the keys' own indices,
for any Nq and Nk: query i sees keys [key_bounds[:, 0, i], key_bounds[:, 1, i]) (intersected
with causal and the window). It is how a block of a longer sequence is told its share of a
mask, when its queries and keys come from different places of that sequence (a context-parallel
ring's chunk pairs, model/ring_attention.py). `bounds_buffer` lays the intervals out as the
kernels read them, with their transpose (the queries that see each key) for the dK/dV kernel.
"""
from __future__ import annotations

import weakref

import torch


def check_masks(q, k, causal: bool, document_ids, window, key_bounds=None):
    """Raise ValueError naming the argument when the masks cannot apply to q (B, Nq, H, D), k."""
    B, n_q = q.shape[0], q.shape[1]
    n_k = k.shape[1]
    if key_bounds is not None:
        if not _is_integer_tensor(key_bounds) or tuple(key_bounds.shape) != (B, 2, n_q):
            raise ValueError(f"key_bounds must be an integer tensor of shape (batch, 2, queries) = {(B, 2, n_q)}, "
                             f"got {getattr(key_bounds, 'dtype', type(key_bounds).__name__)} "
                             f"{tuple(getattr(key_bounds, 'shape', ()))}")
        if key_bounds.device != q.device:
            raise ValueError(f"key_bounds is on {key_bounds.device} but q is on {q.device}")
        if document_ids is not None:
            raise ValueError("pass document_ids or key_bounds, not both (key_bounds can hold the documents too)")
    if document_ids is not None:
        if not _is_integer_tensor(document_ids):
            raise ValueError("document_ids must be an integer torch.Tensor of shape (batch, seqlen)")
        if tuple(document_ids.shape) != (B, n_k):
            raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}; expected (batch, seqlen) = {(B, n_k)}")
        if n_q != n_k:
            raise ValueError(f"document_ids needs as many queries as keys, got {n_q} queries and {n_k} keys")
        if document_ids.device != q.device:
            raise ValueError(f"document_ids is on {document_ids.device} but q is on {q.device}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int (keys each query sees), got {window!r}")
        if not causal:
            raise ValueError("window needs causal=True: it is causal local attention (each query sees the last window keys)")


def _is_integer_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def document_bounds(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, 2, N) int32: [:, 0, i] is the first position of token i's document, [:, 1, i] one past its last.

    Device-wide ops only, over the flattened batch: one `cumsum` numbers the runs (each row's first
    token opens one), and `searchsorted` of a token's own run number in that nondecreasing numbering
    finds where its run starts and ends. A scan along each row (cummax/cummin) would be one thread
    block walking the whole row, paid in every attention call (kernels/LOG.md, 2026-12-06).
    """
    b, n = document_ids.shape
    edge = torch.ones_like(document_ids[:, :1], dtype=torch.bool)
    opens = torch.cat([edge, document_ids[:, 1:] != document_ids[:, :-1]], dim=1)
    run = torch.cumsum(opens.flatten(), 0, dtype=torch.int32)         # nondecreasing over the batch
    start = torch.searchsorted(run, run, right=False, out_int32=True)  # first flat index of the run
    end = torch.searchsorted(run, run, right=True, out_int32=True)     # one past its last
    row = torch.arange(b * n, device=document_ids.device, dtype=torch.int32) // n * n   # each token's row start
    return torch.stack([start - row, end - row]).view(2, b, n).transpose(0, 1).contiguous()


_LAST = None   # bounds_buffer's last (weak source, (version, n_k, documents?), buffer)


def bounds_buffer(document_ids=None, key_bounds=None, n_k: int = 0) -> torch.Tensor | None:
    """What the kernels read for a mask of per-query intervals (kernels/tiles.py): (B, 2 Nq + 2 Nk + 1)
    int32, per batch row [lo (Nq), hi (Nq), the first query seeing each key (Nk), one past the last
    (Nk), nondecreasing]. None without documents or key bounds.

    Documents are their own transpose (the queries that see key j are its document's). For key
    bounds the transpose is exact when lo and hi are both nondecreasing in the query, as every
    causal, window and document mask and their pieces are: queries [#{i: hi_i <= j}, #{i: lo_i <= j})
    see key j. The last entry says whether they are; when not, the kernels visit every tile
    masked (still exact, just without skipping), so no bounds give a wrong answer.

    Every layer of a model passes the same ids (or key bounds) tensor, and a build is a dozen small
    launches (~0.07 ms, benchmarks/attention/document_bounds_h100.md): so an eager call given the
    very tensor of the call before, unchanged since (its version counter), gets that call's buffer
    again rather than a new one. The buffer is only read, by the kernels and by autograd.
    """
    source = document_ids if document_ids is not None else key_bounds
    if source is None:
        return None
    if torch.compiler.is_compiling() or source.is_inference():   # no version counter to key on
        return _build_bounds(document_ids, key_bounds, n_k)
    global _LAST
    key = (source._version, n_k, document_ids is not None)
    if _LAST is not None and _LAST[0]() is source and _LAST[1] == key:
        return _LAST[2]
    buffer = _build_bounds(document_ids, key_bounds, n_k)
    _LAST = (weakref.ref(source), key, buffer)   # weak: a freed tensor's reused id never matches
    return buffer


def _build_bounds(document_ids, key_bounds, n_k: int) -> torch.Tensor:
    """bounds_buffer's layout, built from the ids or else the key bounds."""
    if document_ids is not None:
        bounds = document_bounds(document_ids)
        return torch.cat([bounds.flatten(1), bounds.flatten(1), torch.ones_like(bounds[:, 0, :1])], dim=1)
    rows = key_bounds.clamp(0, n_k).to(torch.int32)
    lo, hi = rows[:, 0].contiguous(), rows[:, 1].contiguous()
    keys = torch.arange(n_k, device=rows.device, dtype=torch.int32).expand(rows.shape[0], n_k).contiguous()
    first = torch.searchsorted(hi, keys, right=True, out_int32=True)
    after_last = torch.searchsorted(lo, keys, right=True, out_int32=True)
    nondecreasing = ((lo[:, 1:] >= lo[:, :-1]).all(1, keepdim=True) & (hi[:, 1:] >= hi[:, :-1]).all(1, keepdim=True))
    return torch.cat([lo, hi, first, after_last, nondecreasing.to(torch.int32)], dim=1)


def visible_mask(n_q: int, n_k: int, causal: bool, document_ids=None, window=None, device=None, key_bounds=None):
    """Boolean (B or 1, Nq, Nk): True where query i may see key j; None when every key is visible."""
    if not causal and document_ids is None and window is None and key_bounds is None:
        return None
    rows = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)   # query positions among the keys
    cols = torch.arange(n_k, device=device)[None, :]
    mask = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        mask &= cols <= rows
    if window is not None:
        mask &= cols > rows - window
    mask = mask[None]
    if document_ids is not None:
        ids = document_ids.to(device)
        run = torch.cat([torch.zeros_like(ids[:, :1]), (ids[:, 1:] != ids[:, :-1]).long().cumsum(1)], dim=1)
        mask = mask & (run[:, :, None] == run[:, None, :])
    if key_bounds is not None:
        lo, hi = key_bounds.to(device)[:, 0, :, None], key_bounds.to(device)[:, 1, :, None]
        mask = mask & (cols[None] >= lo) & (cols[None] < hi)
    return mask
