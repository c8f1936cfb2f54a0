"""Tile shapes the kernels may use, and how one is chosen.

On a GPU each kernel is autotuned over a short list (picked per padded head dim by
`_for_head_dim`, since a 256-wide head needs smaller tiles to fit in shared memory).
FLASHTRAIN_AUTOTUNE=0 pins the first entry of each list, which is what the GPU tests
use to avoid compiling every candidate for every head dim; sequences longer than
TUNE_MAX_TOKENS always use that first entry. Under TRITON_INTERPRET=1
(CPU) block shapes only cost Python time, so one small tile is used.
"""
from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping
from types import MappingProxyType

import triton
from triton.runtime.autotuner import Autotuner

from kernels.checks import INTERPRET
from kernels.launch import next_power_of_2

AUTOTUNE = os.environ.get("FLASHTRAIN_AUTOTUNE", "1") != "0"


def _cfg(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


def _entry(config):
    return (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)


# Every table: (BLOCK_M query rows, BLOCK_N key rows, warps, stages) per max padded head dim, the
# first entry the default. Which of the two a program owns and which it streams is the kernel's.
# Candidates are the shapes that compile without register spills for triton 3.6 / sm_90a
# (ptxas -v; kernels/LOG.md), plus the best measured ones.
_FWD = {  # BLOCK_M queries owned, BLOCK_N keys streamed
    64: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
    256: [(128, 32, 8, 2), (64, 32, 4, 2), (64, 32, 4, 3)],
}
_BWD_KV = {  # BLOCK_M queries streamed, BLOCK_N keys owned
    64: [(32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2)],
    128: [(32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 8, 3), (64, 128, 8, 3)],
    256: [(32, 64, 8, 2), (32, 32, 4, 2), (32, 64, 4, 2)],
}
# Causal dK/dV: the pinned default where the tuner's pick differs from the non-causal one.
# Masking makes half the tiles partial, and the tuner picked these at 4K and 16K on the
# H200 (benchmarks/attention/attention_h200_training.md); pinned, the first entries ran the causal
# backward past 128K at 0.8x the tuned rate (kernels/LOG.md, "Long sequences").
_BWD_KV_CAUSAL = {64: (64, 64, 4, 2), 128: (64, 128, 8, 2)}
# The atomic dK/dV/dQ kernel (deterministic=False) holds a BLOCK_M x D float32 dQ tile on top of
# dK/dV's registers: ptxas -v (triton 3.9, sm_90a, causal) spills 136 B at D = 64 with 128 keys x
# 32 queries (0 for dK/dV alone), 0 with 128 x 16 and 64 x 32 (keys x queries, 8 warps); at D = 128
# every shape spills, least with 64 x 32 (480 B) and 128 x 16 (648 B). Each (key tile, query tile) pair adds a
# BLOCK_M x D tile to dQ, so the atomic bytes per call fall as 1 / BLOCK_N: the pinned default
# (past TUNE_MAX_TOKENS, causal or not) keeps 128 keys per program.
_BWD_KV_DQ = {  # BLOCK_M queries streamed, BLOCK_N keys owned
    64: [(32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 8, 2), (64, 128, 8, 2)],
    128: [(32, 128, 8, 3), (32, 64, 8, 2), (16, 128, 8, 3), (64, 128, 8, 2)],
    256: [(32, 64, 8, 2), (32, 32, 4, 2), (32, 64, 4, 2)],
}
_BWD_Q = {  # BLOCK_M queries owned, BLOCK_N keys streamed
    64: [(128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)],
    128: [(128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)],
    256: [(128, 32, 8, 2), (64, 32, 4, 2), (64, 32, 4, 3)],
}


def _configs(table):
    if INTERPRET:
        return [_cfg(32, 32, 4, 1)]
    unique = dict.fromkeys(entry for entries in table.values() for entry in entries)
    return [_cfg(*entry) for entry in unique]


# Autotuning runs every candidate on the real inputs. Past this length one call takes
# seconds (a causal 1M-token forward of 12 heads is ~4 s), so tuning would cost minutes:
# such lengths use the pinned default, which the candidates' order puts first.
TUNE_MAX_TOKENS = 131072


def seq_bucket(n: int) -> int:
    """Autotuning key: re-tune per power-of-two length band, not per exact length;
    every length past TUNE_MAX_TOKENS shares one band that is never tuned."""
    return min(max(1 << (n - 1).bit_length() if n > 0 else 1, 128), 2 * TUNE_MAX_TOKENS)   # next power of two


# Per kernel of kernels/flash_fwd.py and flash_bwd.py: its table, and its causal pinned default
# where that differs from the table's first entry.
TABLES = {"fwd": (_FWD, None), "bwd_q": (_BWD_Q, None), "bwd_kv": (_BWD_KV, _BWD_KV_CAUSAL),
          "bwd_kv_dq": (_BWD_KV_DQ, None)}


def tunes(length: int) -> bool:
    """Whether calls of this length are autotuned (else every kernel runs its pinned tile)."""
    return AUTOTUNE and not INTERPRET and seq_bucket(length) <= TUNE_MAX_TOKENS


def pinned(kernel: str, head_dim: int, causal: bool) -> Mapping:
    """The pinned tile of `kernel` (a TABLES name) as launch keywords: BLOCK_M, BLOCK_N,
    num_warps, num_stages. Read-only, and computed once: every eager launch of a pinned tile asks."""
    return _pinned(kernel, head_dim, causal, INTERPRET)


@functools.cache
def _pinned(kernel: str, head_dim: int, causal: bool, interpret: bool) -> Mapping:
    if interpret:
        return MappingProxyType(_cfg(32, 32, 4, 1).all_kwargs())
    table, causal_default = TABLES[kernel]
    dim = min(d for d in table if d >= max(16, next_power_of_2(head_dim)))
    entry = (causal_default or {}).get(dim, table[dim][0]) if causal else table[dim][0]
    return MappingProxyType(_cfg(*entry).all_kwargs())


def _for_head_dim(table, causal_default=None):
    """early_config_prune hook: keep the candidates listed for this BLOCK_D; untuned, the
    pinned default (the list's first entry, or `causal_default[dim]` for causal calls)."""
    def prune(configs, named_args, **kwargs):
        if INTERPRET:
            return configs
        dim = min(d for d in table if d >= kwargs["BLOCK_D"])
        tune = AUTOTUNE and named_args["seq_bucket"] <= TUNE_MAX_TOKENS
        pinned = (causal_default or {}).get(dim, table[dim][0]) if kwargs.get("CAUSAL") else table[dim][0]
        wanted = table[dim] if tune else [pinned]
        keep = [c for c in configs if _entry(c) in wanted]
        return sorted(keep, key=lambda c: wanted.index(_entry(c)))
    return prune


def persistent() -> dict:
    """Autotuner arguments that keep tuning results on disk, in Triton's cache (TRITON_CACHE_DIR,
    default ~/.triton/cache), keyed by Triton's version, the GPU architecture, the kernel's
    source, the tuning key (head dim, causal, length band) and the candidate list: a second
    process with the same shapes starts without re-timing every candidate. Triton releases
    without the option tune in every process, as before."""
    if "cache_results" in inspect.signature(Autotuner.__init__).parameters and not INTERPRET:
        return {"cache_results": True}
    return {}


def fwd_configs():
    return _configs(_FWD)


def fwd_prune():
    return {"early_config_prune": _for_head_dim(_FWD)}


def bwd_kv_configs():
    return _configs(_BWD_KV)


def bwd_kv_prune():
    return {"early_config_prune": _for_head_dim(_BWD_KV, _BWD_KV_CAUSAL)}


def bwd_kv_dq_configs():
    return _configs(_BWD_KV_DQ)


def bwd_kv_dq_prune():
    return {"early_config_prune": _for_head_dim(_BWD_KV_DQ)}


def bwd_q_configs():
    return _configs(_BWD_Q)


def bwd_q_prune():
    return {"early_config_prune": _for_head_dim(_BWD_Q)}
