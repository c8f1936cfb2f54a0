"""scripts/max_context.py: the search on fake budgets, the CPU meter, and a CPU run end to end."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import _common  # noqa: E402
import max_context  # noqa: E402
from _memory import CudaPeak, LiveTensorMeter, is_oom, release_memory  # noqa: E402
from max_context import Probe, find_max_length  # noqa: E402


@pytest.fixture
def single_thread():
    """A 1-layer model on a shared 2-core machine: OpenMP threads would only wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def budget(limit: int, log: list[int] | None = None):
    """A fake step that fits when length <= limit, recording the lengths it was asked for."""
    def probe(n: int) -> Probe:
        if log is not None:
            log.append(n)
        return Probe(n, fits=n <= limit, peak_bytes=n if n <= limit else None)
    return probe


@pytest.mark.parametrize("limit, start, granularity, cap, expected", [
    (11_500, 1024, 1024, 1 << 20, 11 * 1024),      # between multiples: rounds down
    (12 * 1024, 1024, 1024, 1 << 20, 12 * 1024),   # exactly on a multiple
    (131_072, 1024, 1024, 1 << 20, 131_072),       # exactly on a doubling
    (131_071, 1024, 1024, 1 << 20, 130_048),
    (5000, 4096, 1024, 65536, 4096),
    (3000, 4096, 1024, 65536, 2048),               # start too long: bisects below it
    (1023, 1024, 1024, 65536, 0),                  # nothing fits
    (0, 8192, 1024, 65536, 0),
    (10**9, 1024, 1024, 3 * 1024, 3 * 1024),      # cap not a power-of-two multiple of start
])
def test_find_max_length_finds_the_boundary(limit, start, granularity, cap, expected):
    log: list[int] = []
    search = find_max_length(budget(limit, log), start, granularity, cap)
    assert search.max_length == expected
    assert [p.length for p in search.probes] == log
    assert len(set(log)) == len(log), "a length was probed twice"
    assert all(n % granularity == 0 and granularity <= n <= cap for n in log)
    if expected < cap:
        assert expected + granularity in log, "the failure just above the answer must be observed"
        assert not search.capped


def test_everything_fits_up_to_the_cap_stops_there():
    log: list[int] = []
    search = find_max_length(budget(10**9, log), 1024, 1024, 2 * 1024 * 1024)
    assert search.max_length == 2 * 1024 * 1024 and search.capped
    assert log == [1024 << k for k in range(12)]  # doubling only, no bisection


def test_million_token_boundary_takes_logarithmically_many_probes():
    search = find_max_length(budget(1_300_000), 1024, 1024, 2 * 1024 * 1024)
    assert search.max_length == 1_299_456  # 1269 * 1024
    assert len(search.probes) <= 12 + 10


def test_non_monotone_fit_still_returns_a_verified_boundary():
    """A hole at 17K-23K that bisection steps over: the answer is still a probed fit (28K) with a
    probed failure just above it."""
    fits = lambda n: n <= 16 * 1024 or 24 * 1024 <= n <= 28 * 1024  # noqa: E731
    search = find_max_length(lambda n: Probe(n, fits(n)), 1024, 1024, 64 * 1024)
    outcome = {p.length: p.fits for p in search.probes}
    assert search.max_length == 28 * 1024
    assert outcome[search.max_length] and not outcome[search.max_length + 1024]


@pytest.mark.parametrize("kwargs, message", [
    (dict(start=1000, granularity=1024, cap=4096), "start=1000"),
    (dict(start=1024, granularity=0, cap=4096), "granularity=0"),
    (dict(start=8192, granularity=1024, cap=4096), "exceeds cap"),
    (dict(start=1024, granularity=1024, cap=5000), "cap=5000"),
])
def test_find_max_length_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        find_max_length(budget(1), **kwargs)


def test_live_tensor_meter_counts_new_tensors_and_raises_like_an_allocator(single_thread):
    x = torch.randn(256, 256, requires_grad=True)   # exists before: the baseline's business
    mib = 2**20
    with LiveTensorMeter() as meter:
        y = (x @ x).relu()       # 256 KiB each
        view = y.t()             # a view: no new bytes
        y.sum().backward()
        del y, view
    assert 2 * 256 * 1024 <= meter.peak < 2 * mib
    assert meter.current == x.grad.nbytes  # all but the gradient freed again
    with pytest.raises(torch.OutOfMemoryError):
        with LiveTensorMeter(baseline=mib // 2, budget=mib):
            torch.empty(mib, dtype=torch.uint8)


def config_from_args(argv: list[str]):
    """What `python scripts/max_context.py argv` runs on."""
    args = max_context.parse_args(argv)
    return max_context.compose_config(args.overrides, args.attention, args.out, args.name)


def test_the_default_output_is_outside_the_committed_results():
    """An ad-hoc search writes under outputs/ (git-ignored); benchmarks/ only with --out benchmarks."""
    cfg = config_from_args(["model.vocab_size=256"])
    assert Path(cfg.out_dir) == _common.OUTPUTS / "max_context"   # the checkout's outputs/ outside the tests
    assert config_from_args(["--out", "benchmarks"]).out_dir == "benchmarks"


def test_cpu_run_end_to_end(tmp_path, single_thread):
    """Tiny model on a budget: each implementation's search, the outputs, naive fitting least."""
    # 8 heads of width 8: naive's N x N scores dominate its memory, as they do at scale
    overrides = ["model.vocab_size=256", "model.n_layer=1", "model.d_model=64", "model.n_head=8",
                 "model.n_kv_head=8", "--attention", "naive,sdpa", "features=[plain,ckpt+chunked]",
                 "skip=[sdpa/ckpt+chunked]", "start=256", "granularity=256", "cap=8192",
                 "memory_budget_mb=12", "--out", str(tmp_path), "--name", "mc", "device=cpu"]
    report = max_context.run(config_from_args(overrides))

    saved = json.loads((tmp_path / "mc.json").read_text())
    assert saved["results"] == report["results"]
    assert saved["metadata"]["device_type"] == "cpu" and saved["metadata"]["torch"] == torch.__version__
    found = {(r["impl"], r["features"]): r for r in saved["results"]}
    assert set(found) == {("naive", "plain"), ("sdpa", "plain"), ("naive", "ckpt+chunked")}
    for r in found.values():
        assert r["error"] is None and 0 < r["max_length"] < 8192 and not r["capped"]
        assert any(not p["fits"] and "out of memory" in p["error"] for p in r["probes"])
        fitted = [p for p in r["probes"] if p["fits"]]
        assert all(p["peak_bytes"] <= 12 * 2**20 and p["tokens_per_s"] > 0 for p in fitted)
    assert found["sdpa", "plain"]["max_length"] >= 2 * found["naive", "plain"]["max_length"]
    assert found["naive", "ckpt+chunked"]["max_length"] >= found["naive", "plain"]["max_length"]
    table = (tmp_path / "mc.md").read_text()
    assert "vs naive" in table and "only CUDA runs give real figures" in table
    for png in ("mc_memory.png", "mc_max.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"

    # A second run extends the same files: completed searches are kept, the missing one is added.
    extended = max_context.run(config_from_args(
        [o for o in overrides if not o.startswith(("skip=", "features="))]
        + ["features=[ckpt+chunked]", "extend=true"]))
    pairs = [(r["impl"], r["features"]) for r in extended["results"]]
    assert pairs == [*found, ("sdpa", "ckpt+chunked")]
    assert extended["results"][:3] == saved["results"]
    added = extended["results"][3]
    assert added["error"] is None and added["max_length"] >= found["sdpa", "plain"]["max_length"]
    assert (tmp_path / "mc.md").read_text().count("| ckpt+chunked |") == 2
    with pytest.raises(ValueError, match="different model"):
        max_context.run(config_from_args([o for o in overrides if not o.startswith("model.d_model=")]
                                         + ["extend=true", "model.d_model=32"]))


@pytest.mark.parametrize("override, message", [
    ("--attention naive,fast", "--attention: 'fast' is not registered"),
    ("features=[plain,turbo]", "'turbo' is not in feature_sets"),
    ("skip=[flash/plain]", "skip: 'flash/plain'"),
    ("cap=4194304", "model.max_seq_len"),
])
def test_bad_settings_are_refused_before_any_model_is_built(override, message):
    cfg = config_from_args(["model.vocab_size=256", "--attention", "naive", "memory_budget_mb=8",
                            "device=cpu", *override.split()])
    with pytest.raises(ValueError, match=message):
        max_context.validate(cfg, torch.device("cpu"))


def test_the_obvious_cpu_command_needs_no_budget_vocabulary_or_gpu(tmp_path, single_thread, monkeypatch):
    """No memory_budget_mb, model.vocab_size from the tokenizer, flash left out with a note where
    neither CUDA nor the interpreter is there: the README's command style works on a CPU on the
    first try."""
    import model.attention
    monkeypatch.setattr(model.attention, "INTERPRET", False)
    report = max_context.run(config_from_args(["--attention", "naive,sdpa,flash", "model.n_layer=1", "start=128",
                                               "granularity=128", "cap=256", "device=cpu", "--out", str(tmp_path)]))
    assert [r["impl"] for r in report["results"]] == ["naive", "sdpa"]
    assert all(r["error"] is None and r["max_length"] == 256 for r in report["results"])
    settings = report["settings"]
    assert settings["cpu_step_budget_mb"] == max_context.CPU_STEP_BUDGET_MB and report["model"]["vocab_size"] == 320
    assert any(n.startswith("flash left out: attention=flash needs a CUDA device") for n in settings["notes"])
    md = (tmp_path / "max_context_cpu.md").read_text()
    assert "flash left out" in md and "state + 16 MiB live-tensor budget" in md and "| flash |" not in md


def test_a_search_where_nothing_fits_says_why_and_what_to_change(tmp_path, single_thread, capsys):
    """It printed a table of zeros and exited 0 (gpt2-small at 1,024 tokens on the CPU's budget)."""
    report = max_context.run(config_from_args(["--attention", "sdpa", "model.n_layer=1", "device=cpu",
                                               "memory_budget_mb=2", "--out", str(tmp_path)]))
    assert [(r["max_length"], len(r["probes"])) for r in report["results"]] == [(0, 1)]
    out = " ".join(capsys.readouterr().out.split())
    assert ("Nothing fitted in sdpa · plain: one step of 1 x 64 tokens needs more live tensor bytes than the CPU's "
            "budget (memory_budget_mb=2: 2.0 MiB, of which ") in out
    assert "Raise memory_budget_mb (the whole budget, in MiB: more than the state's" in out
    assert "Nothing fitted in sdpa · plain" in (tmp_path / "max_context_cpu.md").read_text()


def test_without_a_name_an_earlier_result_is_kept(tmp_path, single_thread, capsys):
    argv = ["--attention", "sdpa", "model.n_layer=1", "device=cpu", "start=64", "cap=64", "--out", str(tmp_path)]
    max_context.run(config_from_args(argv))
    first = (tmp_path / "max_context_cpu.json").read_text()
    max_context.run(config_from_args(argv))
    assert (tmp_path / "max_context_cpu.json").read_text() == first and (tmp_path / "max_context_cpu_2.json").exists()
    assert "max_context_cpu.json in" in capsys.readouterr().out
    max_context.run(config_from_args(argv + ["--name", "max_context_cpu"]))   # named: replaced, on purpose
    assert (tmp_path / "max_context_cpu.json").read_text() != first and not (tmp_path / "max_context_cpu_3.json").exists()


def test_extend_needs_an_earlier_report(tmp_path):
    cfg = config_from_args(["model.vocab_size=256", "--attention", "naive", "memory_budget_mb=8",
                            "device=cpu", "--out", str(tmp_path), "extend=true"])
    with pytest.raises(ValueError, match="max_context_cpu.json does not exist"):
        max_context.run(cfg)


@pytest.mark.parametrize("exc, oom", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (ValueError("sequence length 2097152 exceeds model.max_seq_len=1048576"), False),
])
def test_only_allocation_failures_count_as_not_fitting(exc, oom):
    assert is_oom(exc) is oom


def test_plots_survive_a_run_where_nothing_was_measured(tmp_path):
    """The plots are redrawn after every search, so the first one may have failed outright."""
    report = {"results": [{"impl": "naive", "features": "plain", "max_length": None, "capped": False,
                           "error": "ValueError: x", "granularity": 1024, "probes": []}],
              "metadata": {"device": "cpu", "device_type": "cpu"}, "settings": {"batch_size": 1},
              "model": {"name": "tiny"}}
    max_context.plot(tmp_path / "mc", report)
    assert (tmp_path / "mc_memory.png").exists() and (tmp_path / "mc_max.png").exists()


def test_cuda_peak_survives_the_cleanup_after_a_probe(monkeypatch):
    """A probe reads its peak after release_memory() has reset the allocator's statistics;
    the meter must keep what it saw (on the H200 it once reported only the weights)."""
    import torch
    stats = {"peak": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: stats.update(peak=5))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats["peak"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    meter = CudaPeak(torch.device("cuda"))
    with meter:
        stats["peak"] = 100  # the step's high-water mark
    release_memory(torch.device("cuda"))
    assert stats["peak"] == 5 and meter.peak == 100


# ----------------------------------------------------------------------------- profile_step.py

def test_profile_step_config_and_refusals():
    """profile_step.py composes max_context's config plus `length`, and refuses bad input in one
    ValueError before building anything (it needs CUDA, so the CPU run ends at that refusal)."""
    import profile_step

    cfg = max_context.compose_config(["model=tiny", "length=4096"], ["flash"], config_name="profile_step")
    assert (cfg.length, cfg.cap, cfg.impls[0], cfg.features[0]) == (4096, 4096, "flash", "ckpt+chunked")
    with pytest.raises(ValueError, match="profile one implementation at a time"):
        profile_step.main(["--attention", "flash,sdpa", "model=tiny"])
    with pytest.raises(ValueError, match="length=0: must be a positive integer"):
        profile_step.main(["model=tiny", "length=0"])
    with pytest.raises(ValueError, match="model.max_seq_len"):
        profile_step.main(["model=tiny", "model.max_seq_len=1024", "length=2048"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            profile_step.main(["model=tiny", "length=1024"])


def test_kernel_setup_time_splits_compile_from_tuning(monkeypatch):
    """A once-timed long step reports what it spent compiling and autotuning Triton kernels: compiles
    inside a candidate's timing count as compile time, and Triton's methods come back on exit."""
    import time

    from _first_call import KernelSetupTime
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def compile_(self, *args, **kwargs):
        time.sleep(0.05)

    def bench(self, *args, **kwargs):
        JITFunction._do_compile(None)   # a candidate compiled while it is timed
        time.sleep(0.05)

    monkeypatch.setattr(JITFunction, "_do_compile", compile_)
    monkeypatch.setattr(Autotuner, "_bench", bench)
    with KernelSetupTime() as setup:
        JITFunction._do_compile(None)
        Autotuner._bench(None)
    assert 0.09 < setup.compile_s < 0.2 and 0.04 < setup.tune_s < 0.09, (setup.compile_s, setup.tune_s)
    assert JITFunction._do_compile is compile_ and Autotuner._bench is bench
    JITFunction._do_compile(None)
    assert setup.compile_s < 0.2   # no longer counted
