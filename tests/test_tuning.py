"""Which tile shapes the autotuner may try (the GPU's choice among them is measured there)."""
import pytest

from kernels import tuning



@pytest.fixture
def prune(monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRET", False)
    monkeypatch.setattr(tuning, "AUTOTUNE", True)
    unique = dict.fromkeys(e for entries in tuning._FWD.values() for e in entries)  # as _configs builds them
    candidates = [tuning._cfg(*entry) for entry in unique]
    hook = tuning._for_head_dim(tuning._FWD)
    return lambda block_d, n: [tuning._entry(c) for c in
                               hook(candidates, {"seq_bucket": tuning.seq_bucket(n)}, BLOCK_D=block_d)]


@pytest.mark.parametrize("block_d, table_dim", [(16, 64), (64, 64), (128, 128), (256, 256)])
def test_candidates_follow_the_padded_head_dim(prune, block_d, table_dim):
    assert prune(block_d, 4096) == tuning._FWD[table_dim]


def test_very_long_sequences_use_the_pinned_default(prune):
    """Tuning at a million tokens would time every candidate for seconds per call."""
    assert prune(128, tuning.TUNE_MAX_TOKENS) == tuning._FWD[128]
    assert prune(128, tuning.TUNE_MAX_TOKENS + 1) == tuning._FWD[128][:1]
    assert prune(128, 1 << 20) == tuning._FWD[128][:1]


def test_autotune_off_pins_the_default(prune, monkeypatch):
    monkeypatch.setattr(tuning, "AUTOTUNE", False)
    assert prune(64, 4096) == tuning._FWD[64][:1]


def test_length_bands():
    assert tuning.seq_bucket(1) == 128
    assert tuning.seq_bucket(1000) == 1024 and tuning.seq_bucket(1024) == 1024
    assert tuning.seq_bucket(1 << 20) == tuning.seq_bucket(1 << 22) == 2 * tuning.TUNE_MAX_TOKENS


def _kept(table: dict, prune, dim: int, causal: bool, tokens: int = 1 << 20) -> list:
    """(BLOCK_M, BLOCK_N, warps, stages) entries a dK/dV kernel's prune hook keeps at `tokens`
    (default 1M, past the tuning limit), out of every candidate in its table."""
    unique = dict.fromkeys(e for entries in table.values() for e in entries)
    candidates = [tuning._cfg(*entry) for entry in unique]
    kept = prune()["early_config_prune"](candidates, {"seq_bucket": tuning.seq_bucket(tokens)},
                                         BLOCK_D=dim, CAUSAL=causal)
    return [tuning._entry(c) for c in kept]


def test_causal_backward_pins_its_own_default(monkeypatch):
    """Past the tuning limit the causal dK/dV kernel runs the shape the tuner picks for causal."""
    monkeypatch.setattr(tuning, "INTERPRET", False)
    for dim in (64, 128):
        causal = _kept(tuning._BWD_KV, tuning.bwd_kv_prune, dim, True)
        plain = _kept(tuning._BWD_KV, tuning.bwd_kv_prune, dim, False)
        assert causal == [tuning._BWD_KV_CAUSAL[dim]] and tuning._BWD_KV_CAUSAL[dim] in tuning._BWD_KV[dim]
        assert plain == tuning._BWD_KV[dim][:1]


def test_tuning_results_persist_where_triton_can(monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRET", False)
    import inspect
    from triton.runtime.autotuner import Autotuner
    supported = "cache_results" in inspect.signature(Autotuner.__init__).parameters
    assert tuning.persistent() == ({"cache_results": True} if supported else {})
    monkeypatch.setattr(tuning, "INTERPRET", True)
    assert tuning.persistent() == {}


def test_atomic_backward_pins_128_keys_per_program(monkeypatch):
    """Past the tuning limit the atomic dK/dV/dQ kernel keeps BLOCK_N = 128, causal or not: its
    float32 atomic traffic per call falls as 1 / BLOCK_N."""
    monkeypatch.setattr(tuning, "INTERPRET", False)
    for dim in (64, 128):
        for causal in (False, True):
            pinned = _kept(tuning._BWD_KV_DQ, tuning.bwd_kv_dq_prune, dim, causal)
            assert pinned == [tuning._BWD_KV_DQ[dim][0]]
            assert tuning._BWD_KV_DQ[dim][0][1] == 128   # (BLOCK_M, BLOCK_N, warps, stages)
        tuned = _kept(tuning._BWD_KV_DQ, tuning.bwd_kv_dq_prune, dim, True, tokens=4096)
        assert tuned == tuning._BWD_KV_DQ[dim]
