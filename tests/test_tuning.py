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


class _FakeAutotuner:
    """Records how flash_op launches an autotuned kernel: through the autotuner (`tune`) or straight
    to the jitted function with a tile (`direct`)."""

    def __init__(self, record):
        import triton
        self.record, self.configs_timings = record, None
        self.best_config = triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2)
        self.fn = self

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if "num_warps" in kwargs:
                self.record.append(("direct", kwargs["BLOCK_M"], kwargs["num_warps"]))
            else:
                self.record.append(("tune",))
                self.configs_timings = {self.best_config: 1.0}   # as the autotuner leaves it after timing
        return launch


def test_the_autotuner_is_asked_once_per_band_and_never_for_pinned_tiles(monkeypatch, caplog):
    """A band's first call tunes (and says so), later calls launch the pick directly; past the tuned
    lengths the pinned tile is launched without the autotuner, which would time even one candidate."""
    import logging

    import torch

    from kernels import flash_op

    record = []
    kernel = _FakeAutotuner(record)
    consts = flash_op._constexprs(64, True, False, False, torch.float16)
    monkeypatch.setattr(flash_op, "_TUNED", {})
    monkeypatch.setattr(flash_op, "tunes", lambda length: length <= 4096)
    launch = lambda length: flash_op._launch(kernel, "fwd", (1, 1), (), consts, length, torch.float16,  # noqa: E731
                                             torch.device("cpu"), flash_op._no_wrap, None, ())
    with caplog.at_level(logging.INFO, logger="kernels"):
        launch(4096)
        launch(4000)
    assert record == [("tune",), ("direct", 64, 4)]
    assert any("tuned fwd for head dim 64, causal, lengths up to 4096" in r.getMessage() for r in caplog.records)
    record.clear()
    launch(1 << 20)
    pinned = tuning.pinned("fwd", 64, True)
    assert record == [("direct", pinned["BLOCK_M"], pinned["num_warps"])]
