"""Document masks and sliding windows: the argument checks, the kernel's pre-pass, the dense oracle.

Which keys a query may see is, for every mask this project supports, one interval per
query row. With documents given as per-token ids (B, N) of a packed window, a *document*
is a maximal run of equal ids (so a sampler's nondecreasing ids and any other labelling
of contiguous documents mean the same thing), and query i sees

    keys [doc_start(i), doc_end(i))       documents
    ∩ keys <= i + (Nk - Nq)               causal, aligned bottom-right
    ∩ keys >  i + (Nk - Nq) - window      sliding window (Mistral's causal local attention)

`document_bounds` turns the ids into the two per-token ends, once per call, on the device
(cheap torch ops, traceable by torch.compile, no host sync). The kernels read them to skip
whole tiles and to mask the partial ones (kernels/tiles.py). `visible_mask` builds the same
mask densely, from run ids rather than from those bounds, for the reference and SDPA.
"""
from __future__ import annotations

import torch


def check_masks(q, k, causal: bool, document_ids, window):
    """Raise ValueError naming the argument when the masks cannot apply to q (B, Nq, H, D), k."""
    B, n_q = q.shape[0], q.shape[1]
    n_k = k.shape[1]
    if document_ids is not None:
        if not isinstance(document_ids, torch.Tensor) or document_ids.dtype.is_floating_point \
                or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
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


def document_bounds(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, 2, N) int32: [:, 0, i] is the first position of token i's document, [:, 1, i] one past its last."""
    ids = document_ids
    n = ids.shape[1]
    pos = torch.arange(n, device=ids.device, dtype=torch.int32).expand_as(ids)
    changes = ids[:, 1:] != ids[:, :-1]
    edge = torch.ones_like(ids[:, :1], dtype=torch.bool)
    starts = torch.cat([edge, changes], dim=1)          # token i opens a document
    ends = torch.cat([changes, edge], dim=1)            # token i closes one
    start = torch.cummax(torch.where(starts, pos, 0), dim=1).values
    end = torch.cummin(torch.where(ends, pos + 1, n).flip(1), dim=1).values.flip(1)
    return torch.stack([start, end], dim=1).to(torch.int32).contiguous()


def visible_mask(n_q: int, n_k: int, causal: bool, document_ids=None, window=None, device=None):
    """Boolean (B or 1, Nq, Nk): True where query i may see key j; None when every key is visible."""
    if not causal and document_ids is None and window is None:
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
    return mask
