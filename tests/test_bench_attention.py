"""scripts/bench/bench_attention.py: FLOP accounting and the sweep's plumbing, on CPU-sized shapes.

Our kernel cannot run bf16 under the CPU interpreter, so the plumbing test stands in the plain
formula for it *in the test only*; the other test checks that the script itself never does.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
import bench_attention  # noqa: E402
from _common import device_slug  # noqa: E402
from bench_attention import BACKENDS, Backend, attention_flops  # noqa: E402

import kernels  # noqa: E402
from kernels.reference import attention_reference  # noqa: E402


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def restore_threads():
    """--smoke on the CPU runs single-threaded (tiny shapes); give later tests their threads back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_attention_flops_follow_the_stated_formulas():
    flops = attention_flops(batch=1, heads=16, seq_len=16384, head_dim=128, causal=False)
    assert flops["fwd"] == 4 * 16 * 16384**2 * 128
    assert flops["bwd"] == 2.5 * flops["fwd"] and flops["fwd+bwd"] == 3.5 * flops["fwd"]
    assert attention_flops(1, 16, 16384, 128, causal=True)["fwd"] == flops["fwd"] / 2


def _stand_in_for_ours(causal, seq_len, device):
    return lambda q, k, v: attention_reference(q, k, v, causal=causal)


def _naive_out_of_memory_above_128(causal, seq_len, device):
    if seq_len > 128:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
    return lambda q, k, v: attention_reference(q, k, v, causal=causal)


def test_smoke_sweep_writes_every_measurement(tmp_path, monkeypatch, restore_threads):
    monkeypatch.setitem(BACKENDS, "ours", Backend("ours (test stand-in)", False, _stand_in_for_ours))
    monkeypatch.setitem(BACKENDS, "naive", Backend("naive PyTorch", False, _naive_out_of_memory_above_128))
    bench_attention.main(["--smoke", "--out", str(tmp_path),
                          "--attention", "ours,naive,sdpa-flash,sdpa-cudnn"])
    json_path = tmp_path / f"attention_{device_slug(DEVICE)}_smoke.json"
    report = json.loads(json_path.read_text())

    sweep = bench_attention.SWEEPS["smoke"]
    assert report["metadata"]["torch"] == torch.__version__ and report["settings"]["mode"] == "smoke"
    cells = {(r["backend"], r["D"], r["N"], r["causal"]): r for r in report["throughput"]}
    assert len(cells) == len(report["throughput"]) == 4 * len(sweep.head_dims) * len(sweep.lengths) * 2
    for (name, D, N, causal), r in cells.items():
        assert r["B"] * N == max(sweep.tokens, N) and r["H"] * D == sweep.hidden
        if name == "sdpa-cudnn" and not torch.cuda.is_available():
            assert r["status"] == "unavailable"
            continue
        if name == "naive" and N > 128:
            assert r["status"] == "out of memory" and "fwd_ms" not in r
            continue
        assert r["status"] == "ok", r
        flops = attention_flops(r["B"], r["H"], N, D, causal)
        for p in ("fwd", "bwd", "fwd+bwd"):
            assert r[f"{p}_tflops"] * 1e12 * r[f"{p}_ms"] * 1e-3 == pytest.approx(flops[p])
    if not torch.cuda.is_available():
        assert report["backends"]["sdpa-cudnn"]["status"].startswith("unavailable: ")

    memory = {(r["backend"], r["N"]): r for r in report["memory"]}
    assert [n for (b, n) in memory if b == "naive"] == [64, 128, 256]  # stops at the first failure
    assert memory["naive", 256]["status"] == "out of memory"
    assert memory["naive", 128]["peak_bytes"] > 2 * memory["naive", 64]["peak_bytes"]  # N^2 scores
    assert all(r["peak_bytes"] > r["input_bytes"] for r in report["memory"] if r["status"] == "ok")

    ours, naive = cells["ours", 32, 128, True], cells["naive", 32, 128, True]
    (row,) = [r for r in bench_attention.throughput_rows(report) if r[:4] == [32, "yes", 128, "naive"]]
    assert row[7:] == [f"{ours[p + '_tflops'] / naive[p + '_tflops']:.2f}" for p in ("fwd", "bwd", "fwd+bwd")]
    table = json_path.with_suffix(".md").read_text()
    assert "| 64 | yes | 128 | naive |" in table and "| 64 | yes | 512 | naive | out of memory |" in table
    for png in ("_tflops.png", "_memory.png"):
        assert json_path.with_name(json_path.stem + png).read_bytes()[:4] == b"\x89PNG"


def test_missing_kernel_is_reported_unavailable_never_substituted(tmp_path, monkeypatch, restore_threads):
    monkeypatch.delitem(kernels.__dict__, "flash_attention", raising=False)
    monkeypatch.setitem(sys.modules, "kernels.flash_op", None)   # kernels loads its names lazily from here
    report = bench_attention.main(["--smoke", "--out", str(tmp_path), "--attention", "ours,sdpa-flash"])
    assert report["backends"]["ours"]["status"].startswith("unavailable: ")
    assert "kernels.flash_attention not importable" in report["backends"]["ours"]["status"]
    ours = [r for r in report["throughput"] if r["backend"] == "ours"]
    assert ours and all(r["status"] == "unavailable" and "fwd_tflops" not in r for r in ours)
    assert all(r["status"] == "ok" for r in report["throughput"] if r["backend"] == "sdpa-flash")
    assert report["memory"] == []  # neither memory backend could run
    table = (tmp_path / f"attention_{device_slug(DEVICE)}_smoke.md").read_text()
    assert "| ours | unavailable |" in table


def test_bad_backend_name_is_refused():
    with pytest.raises(ValueError, match="--attention: unknown fa3"):
        bench_attention.main(["--smoke", "--attention", "ours,fa3"])


def test_training_table_gives_ratios_to_both_backwards():
    """--training: each backend's time over ours (deterministic) and over ours-atomic."""
    def row(backend, fwd, bwd, both, **extra):
        r = {"backend": backend, "B": 4, "N": 4096, "H": 12, "Hkv": 12, "D": 64, "causal": True, "status": "ok",
             "fwd_ms": fwd, "bwd_ms": bwd, "fwd+bwd_ms": both, "fwd+bwd_tflops": 100.0}
        return {**r, **extra}
    report = {"training": [row("ours", 1.0, 2.0, 3.0), row("ours-atomic", 1.0, 1.6, 2.5),
                           row("sdpa-default", 0.5, 1.0, 2.0, picked="cuDNN"),
                           {**row("flex", 0, 0, 0), "status": "out of memory"}]}
    ours, atomic, sdpa, flex = bench_attention.training_rows(report)
    assert ours[8:] == ["-", "-", "-", "1.25", "1.20"]
    assert atomic[8:] == ["1.00", "0.80", "0.83", "-", "-"]
    assert sdpa[3] == "sdpa-default (cuDNN)" and sdpa[8:] == ["0.50", "0.50", "0.67", "0.62", "0.80"]
    assert flex[4] == "out of memory" and len(flex) == len(bench_attention.TRAINING_HEADERS)


def test_lanes_of_a_split_training_run_merge_into_one_report(tmp_path):
    def lane(name, heads, backends):
        rows = [{"backend": b, "B": 1, "N": 16384, "H": heads[0], "Hkv": heads[1], "D": heads[2], "causal": True,
                 "status": "ok", "fwd_ms": 1.0, "bwd_ms": 2.0, "fwd+bwd_ms": 3.0, "fwd+bwd_tflops": 1.0}
                for b in backends]
        report = {"metadata": {"device": "GPU", "date": name, "torch": "t", "triton": "t", "git_commit": "c",
                               "command": f"bench_attention.py --heads {name}"},
                  "settings": {"mode": "training", "heads": [heads]},
                  "backends": {b: {"label": b} for b in backends}, "training": rows}
        path = tmp_path / name / "attention_gpu_training.json"
        path.parent.mkdir()
        path.write_text(json.dumps(report))
        return path
    a = lane("a", (12, 12, 64), ("ours", "flex"))
    b = lane("b", (32, 8, 128), ("ours", "ours-atomic"))
    merged = bench_attention.main(["--merge-training", str(a), str(b), "--out", str(tmp_path)])
    assert [(r["H"], r["backend"]) for r in merged["training"]] == [(12, "ours"), (12, "flex"), (32, "ours"),
                                                                   (32, "ours-atomic")]
    assert set(merged["backends"]) == {"ours", "flex", "ours-atomic"}
    assert merged["metadata"]["command"] == "bench_attention.py --heads a ; bench_attention.py --heads b"
    table = (tmp_path / "attention_gpu_training.md").read_text()
    assert "| 32/8 x 128 | 16384 | 1 | ours-atomic |" in table and "| 12/12 x 64 | 16384 | 1 | flex |" in table
    with pytest.raises(ValueError, match="cannot read"):
        bench_attention.main(["--merge-training", str(tmp_path / "missing.json"), "--out", str(tmp_path)])
    other = json.loads(b.read_text())
    other["settings"]["timer"] = "another timer"
    b.write_text(json.dumps(other))
    with pytest.raises(ValueError, match="timed otherwise"):   # lanes' times compare only if timed alike
        bench_attention.main(["--merge-training", str(a), str(b), "--out", str(tmp_path)])


def test_host_overhead_tool_runs_with_stubbed_launches(tmp_path):
    """scripts/bench/bench_attention_host.py --stub (in its own process: it replaces the kernels' launches)."""
    import subprocess
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "bench_attention_host.py"
    proc = subprocess.run([sys.executable, str(script), "--stub", "--kernels", "triton,gluon/triton",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "attention_host.json").read_text())["rows"]
    assert rows["ours-triton"]["launches"] == ["flash_fwd_kernel", "flash_bwd_q_kernel", "flash_bwd_kv_kernel"]
    assert rows["ours-gluon/triton"]["launches"] == ["attention_fwd_ws", "flash_bwd_q_kernel", "flash_bwd_kv_kernel"]
    assert all(row["step_cpu_us"] > 0 for row in rows.values())
