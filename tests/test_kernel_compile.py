"""The kernels compile for Hopper (sm_90a) on a machine without a GPU.

The interpreter that runs the kernel tests on a CPU executes the Python source, so it
accepts things the GPU compiler rejects: a plain float global inside jit code, or
scalar arguments typed fp64 (which is how torch.compile passes Python floats). Both
broke real GPU runs once. Triton can compile to a cubin without a device, so this
compiles every kernel for sm_90a with the signature Inductor uses, in a subprocess
(the test session runs with TRITON_INTERPRET=1, which changes what `triton.jit` returns).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys
sys.path.insert(0, "scripts/kernel_dev")
from kernel_report import compile_for_hopper as compile_kernel, score_args
from kernels.flash_fwd import flash_fwd_kernel
from kernels.flash_bwd import flash_bwd_delta_kernel, flash_bwd_kv_kernel, flash_bwd_q_kernel

def compile_for_hopper(kernel, constexprs, warps, stages, pointers=None, scores=()):
    # Inductor's signature: every int an unspecialised i32, Python floats fp64
    constexprs = dict(constexprs, **score_args(kernel, scores))
    compiled = compile_kernel(kernel, constexprs, warps, stages, values=None, pointers=pointers)
    return "wgmma.mma_async" in compiled.asm["ptx"]

results = {}
# plain causal; the document mask with a sliding window (the most index math); and those with every
# score option (kernels/scores.py: dropout, soft-capping, sinks)
for tag, masks, scores in (("", dict(DOCS=False, WINDOW=False), ()), ("_masked", dict(DOCS=True, WINDOW=True), ()),
                           ("_scores", dict(DOCS=True, WINDOW=True), ("dropout", "softcap", "sinks"))):
    common = dict(HEAD_DIM=96, BLOCK_D=128, CAUSAL=True, PRECISION="tf32", **masks)
    results["fwd" + tag] = compile_for_hopper(flash_fwd_kernel, dict(common, BLOCK_M=128, BLOCK_N=64), 8, 3,
                                              scores=scores)
    results["bwd_kv" + tag] = compile_for_hopper(flash_bwd_kv_kernel, dict(common, BLOCK_N=128, BLOCK_M=32), 8, 3,
                                                 scores=scores)
    results["bwd_q" + tag] = compile_for_hopper(flash_bwd_q_kernel, dict(common, BLOCK_M=128, BLOCK_N=32), 8, 3,
                                                scores=scores)
results["delta"] = compile_for_hopper(flash_bwd_delta_kernel, dict(HEAD_DIM=96, BLOCK_D=128, BLOCK_M=64), 4, 1)
print(json.dumps(results))
"""


def compile_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Compiles:
    """This module's compile subprocesses, each one test's. Each is single-threaded (Python, Triton's
    frontend, LLVM, ptxas), so they run `slots` at a time (one per core) in the order the tests come,
    instead of one after another; only the tests collected in this session start theirs. A test
    waits for its own subprocess and checks its own output, as it did running it itself."""

    def __init__(self, commands: dict[str, list[str]], folder: Path, slots: int):
        self.commands, self.folder, self.slots = commands, folder, max(1, slots)
        self.queue, self.procs = list(commands), {}

    def _start(self, name: str) -> None:
        self.queue.remove(name)
        with open(self.folder / f"{name}.out", "w") as out, open(self.folder / f"{name}.err", "w") as err:
            self.procs[name] = subprocess.Popen(self.commands[name], cwd=REPO, env=compile_env(), stdout=out, stderr=err)

    def _top_up(self) -> None:
        while self.queue and sum(p.poll() is None for p in self.procs.values()) < self.slots:
            self._start(self.queue[0])

    def run(self, name: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """`name`'s subprocess, finished: started now if it has not been."""
        if name not in self.procs:
            self._start(name)
        self._top_up()
        deadline = time.monotonic() + timeout
        while self.procs[name].poll() is None:
            if time.monotonic() > deadline:
                self.procs[name].kill()
                raise subprocess.TimeoutExpired(self.commands[name], timeout)
            time.sleep(0.05)
            self._top_up()
        self._top_up()
        return subprocess.CompletedProcess(self.commands[name], self.procs[name].returncode,
                                           (self.folder / f"{name}.out").read_text(),
                                           (self.folder / f"{name}.err").read_text())

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def compiles(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("compiles")
    scripts = {"test_kernels_compile_for_sm90_with_inductor_signature": SCRIPT,
               "test_atomic_backward_compiles_for_sm90_with_inductor_signature": ATOMIC_SCRIPT,
               "test_gluon_forward_compiles_for_sm90_without_spills": GLUON_SCRIPT,
               "test_decode_kernels_compile_for_sm90_without_spills": DECODE_SCRIPT,
               "test_inductor_sees_each_kernel_write_only_its_outputs": MUTATION_SCRIPT}
    commands = {name: [sys.executable, "-c", script] for name, script in scripts.items()}
    commands["test_pinned_tiles_compile_pipelined_and_spill_free"] = [
        sys.executable, "scripts/kernel_dev/kernel_report.py", "--kernels", "fwd,q,kv", "--limit", "1", "--json",
        "--out", str(folder)]
    here = Path(__file__).resolve()
    collected = [getattr(item, "originalname", item.name) for item in request.session.items
                 if Path(item.path).resolve() == here]
    jobs = Compiles({name: commands[name] for name in collected if name in commands}, folder, os.cpu_count() or 1)
    yield jobs
    jobs.close()


def compile_in_subprocess(compiles: Compiles, name: str) -> dict:
    proc = compiles.run(name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_kernels_compile_for_sm90_with_inductor_signature(compiles, request):
    uses_wgmma = compile_in_subprocess(compiles, request.node.originalname)
    # the three matmul kernels must reach Hopper's tensor-core instructions
    assert uses_wgmma == {"fwd": True, "bwd_kv": True, "bwd_q": True, "fwd_masked": True, "bwd_kv_masked": True,
                          "bwd_q_masked": True, "fwd_scores": True, "bwd_kv_scores": True, "bwd_q_scores": True,
                          "delta": False}, uses_wgmma


ATOMIC_SCRIPT = SCRIPT.split("results = {}")[0] + r"""
from kernels.flash_bwd import flash_bwd_kv_dq_kernel
results = {}
for tag, masks, scores in (("", dict(DOCS=False, WINDOW=False), ()), ("_masked", dict(DOCS=True, WINDOW=True), ()),
                           ("_scores", dict(DOCS=True, WINDOW=True), ("dropout", "softcap"))):
    consts = dict(HEAD_DIM=96, BLOCK_D=128, CAUSAL=True, PRECISION="tf32", BLOCK_N=128, BLOCK_M=32, **masks)
    results["bwd_kv_dq" + tag] = compile_for_hopper(flash_bwd_kv_dq_kernel, consts, 8, 3, {"dQ": "*fp32"}, scores)
print(json.dumps(results))
"""


@pytest.mark.slow
def test_atomic_backward_compiles_for_sm90_with_inductor_signature(compiles, request):
    """The dK/dV kernel that adds dQ with float32 atomics (deterministic=False), plain and masked."""
    assert compile_in_subprocess(compiles, request.node.originalname) == {
        "bwd_kv_dq": True, "bwd_kv_dq_masked": True, "bwd_kv_dq_scores": True}


@pytest.mark.slow
def test_pinned_tiles_compile_pipelined_and_spill_free(compiles, request):
    """Compiled as a launch specialises them (scripts/kernel_dev/kernel_report.py: strides of 1 constant,
    multiples of 16 divisible), the pinned tile shapes of the forward, dQ and dK/dV kernels stream
    their loop tiles through cp.async and spill no registers, at head dims 64 and 128. A change that
    leaves a loop load unpipelined or pushes a kernel into local memory fails here, before any GPU run."""
    proc = compiles.run(request.node.originalname)   # scripts/kernel_dev/kernel_report.py --kernels fwd,q,kv ...
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((Path(proc.args[-1]) / "kernel_report.json").read_text())["rows"]
    assert {(r["kernel"], r["head_dim"]) for r in rows} == {(k, d) for k in ("fwd", "q", "kv") for d in (64, 128)}
    for row in rows:
        assert row["async_copies"] > 0 and row["spill_bytes"] == 0, row


GLUON_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, "scripts/kernel_dev")
from kernel_report import compile_gluon_fwd, ptxas_report
from kernels import gluon
from kernels.lab.gluon_forward_ladder import LADDER

def check(variant, head_dim, causal, **scores):
    compiled = compile_gluon_fwd(variant, head_dim, causal, **scores)
    report = ptxas_report(compiled)
    return {"wgmma": "wgmma.mma_async" in compiled.asm["ptx"], "spill_bytes": report["spill_bytes"],
            "shared_bytes": compiled.metadata.shared}

results = {f"default-{d}-{c}": check(None, d, c) for d in gluon.HEAD_DIMS for c in (False, True)}
results.update({f"{v}-64-True": check(v, 64, True) for v in LADDER})
results.update({f"dropout-{d}-{'packed' if packed else 'unpacked'}": check(None, d, True, dropout_p=0.1, packed_mask=packed)
                for d in gluon.HEAD_DIMS for packed in (False, True)})
results.update({f"softcap-{d}-exp2-fma": check(None, d, True, softcap=30.0, exp2_on_fma=2) for d in gluon.HEAD_DIMS})
print(json.dumps(results))
"""


@pytest.mark.slow
def test_gluon_forward_compiles_for_sm90_without_spills(compiles, request):
    """The Gluon Hopper forward (kernels/gluon/forward.py) compiles for sm_90a under this Triton, no GPU
    needed: the variants flash_attention runs at both head dims, causal and not, every rung of its
    ladder (kernels/lab/gluon_forward_ladder.py) once, with dropout, its mask on P's packed pairs or
    not (kernels/scores.py's PACKED_DROPOUT), and soft-capped with half its exponentials on the FMA
    units (kernels/exp2.py). Each reaches wgmma, spills nothing, and fits the H100/H200's 227 KB of
    shared memory."""
    results = compile_in_subprocess(compiles, request.node.originalname)
    assert len(results) >= 6, results
    for name, r in results.items():
        assert r["wgmma"] and r["spill_bytes"] == 0 and r["shared_bytes"] <= 232448, (name, r)


DECODE_SCRIPT = r"""
import json, sys
sys.path.insert(0, "scripts/kernel_dev")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernel_report import ptxas_report, score_args
from kernels.decode import flash_decode_merge_kernel, flash_decode_split_kernel

def compile_for_hopper(kernel, pointers, floats, constexprs, warps):
    # Inductor-style: every int an unspecialised i32, floats as given; the score options off unless given
    constexprs = {**score_args(kernel), **constexprs}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name) or ("fp64" if name in floats else "i32")
                 for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return ptxas_report(compiled)["spill_bytes"]

split_ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "PartO": "*fp32", "PartLse": "*fp32", "Len": "*i64"}
results = {}
# gpt2-small (one query head per KV head, D = 64), and GQA 8:1 at D = 128 with a window
for tag, consts in (("mha64", dict(GROUP=1, HEAD_DIM=64, BLOCK_R=1, BLOCK_N=64, BLOCK_D=64, WINDOW=False)),
                    ("gqa128_window", dict(GROUP=8, HEAD_DIM=128, BLOCK_R=8, BLOCK_N=16, BLOCK_D=128, WINDOW=True))):
    results["split_" + tag] = compile_for_hopper(flash_decode_split_kernel, split_ptrs, {"qk_scale"},
                                                 dict(consts, SPLIT_N=256), 4)
results["merge"] = compile_for_hopper(flash_decode_merge_kernel, {"PartO": "*fp32", "PartLse": "*fp32", "Out": "*bf16"},
                                      set(), dict(HEAD_DIM=64, BLOCK_S=32, BLOCK_D=64), 1)
print(json.dumps(results))
"""


@pytest.mark.slow
def test_decode_kernels_compile_for_sm90_without_spills(compiles, request):
    """kernels/decode.py, as a CUDA-graph decode step launches it (no GPU here to run it)."""
    assert compile_in_subprocess(compiles, request.node.originalname) == {"split_mha64": 0, "split_gqa128_window": 0, "merge": 0}


MUTATION_SCRIPT = r"""
import json
import torch
import triton
import torch._higher_order_ops.triton_kernel_wrap as inductor_kernels
from triton.backends.compiler import GPUTarget
from triton.runtime.autotuner import Autotuner
from kernels import flash_op
from kernels.masks import bounds_buffer

class Hopper:   # what Inductor asks the driver for, on a machine without one
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
triton.runtime.driver.set_active(Hopper())

launches = []
class Recorder:   # stands in for wrap_triton: records each launch's kernel and arguments
    def __init__(self, kernel):
        self.kernel = kernel
    def __getitem__(self, grid):
        return lambda *args, **consts: launches.append((self.kernel, args, consts))

q = torch.randn(2, 256, 8, 64, dtype=torch.float16)
k, v = torch.randn(2, 256, 2, 64, dtype=torch.float16), torch.randn(2, 256, 2, 64, dtype=torch.float16)
out, lse, do = torch.empty_like(q), torch.empty(2, 8, 256), torch.randn_like(q)
docs = bounds_buffer(torch.repeat_interleave(torch.arange(2), 128)[None].expand(2, -1).contiguous(), None, 256)
scores = dict(softcap=30.0, dropout_p=0.1, rng=torch.zeros(2, dtype=torch.int64))   # kernels/scores.py
results = {}
for tag, bounds, window, options in (("", None, 0, {}), ("_masked", docs, 17, {}), ("_scores", docs, 17, scores)):
    launches.clear()
    flash_op._triton_forward(q, k, v, True, 0.125, bounds, window, Recorder, **options,
                             sinks=torch.zeros(8) if options else None)
    for deterministic in (True, False):
        flash_op._triton_backward(do, q, k, v, out, lse, True, 0.125, bounds, window, deterministic, Recorder,
                                  **options)
    for kernel, args, consts in launches:
        fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
        kwargs = {**dict(zip(fn.arg_names, args)), **consts,
                  **(kernel.configs[0].all_kwargs() if isinstance(kernel, Autotuner) else {})}
        if hasattr(inductor_kernels, "identify_accessed_tensors"):
            written = [d.name for d in inductor_kernels.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes]
        else:
            written = inductor_kernels.identify_mutated_tensors(kernel, kwargs, {})
        results[fn.__name__ + tag] = sorted(n for n in written if isinstance(kwargs.get(n), torch.Tensor))
print(json.dumps(results))
"""


@pytest.mark.slow
def test_inductor_sees_each_kernel_write_only_its_outputs(compiles, request):
    """Under torch.compile, Inductor launches the kernels itself and decides from its own analysis
    of their TTIR which arguments they write; it copies and re-reads those. A slot the kernel never
    uses is filled with another tensor (Docs with the LSE when there is no mask), so an input taken
    for written gives wrong results, not an error: a helper that returned a pointer into Docs once
    made the compiled dK/dV wrong on the GPU while eager was exact. This runs that analysis on the
    CPU, for every launch of the forward and both backwards, with and without masks, and with the
    score options (kernels/scores.py), whose seed and sinks are inputs only."""
    outputs = {"flash_fwd_kernel": ["Lse", "Out"], "flash_bwd_delta_kernel": ["Delta"],
               "flash_bwd_q_kernel": ["Delta", "dQ"], "flash_bwd_kv_kernel": ["dK", "dV"],
               "flash_bwd_kv_dq_kernel": ["dK", "dQ", "dV"]}
    written = compile_in_subprocess(compiles, request.node.originalname)
    assert written == {name + tag: outs for name, outs in outputs.items() for tag in ("", "_masked", "_scores")}


def test_mufu_probe_reads_what_each_form_compiles_to(tmp_path):
    """scripts/kernel_dev/mufu_probe.py --sass under this Triton: a float32 tanh is one MUFU.TANH a
    value, and a packed 16-bit pair two 16-bit MUFU operations, not one (kernels/LOG.md, 2026-12-07,
    late afternoon), so what a 16-bit operation costs is the GPU rate the probe measures."""
    done = subprocess.run([sys.executable, "scripts/kernel_dev/mufu_probe.py", "--sass", "--forms",
                           "tanh f32,tanh bf16x2,ex2 f16x2", "--out", str(tmp_path)],
                          cwd=REPO, env=compile_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["form"]: r for r in json.loads((tmp_path / "mufu_sass.json").read_text())["rows"]}
    for form, op in (("tanh f32", "MUFU.TANH"), ("tanh bf16x2", "MUFU.TANH.BF16"), ("ex2 f16x2", "MUFU.EX2.F16")):
        count, name = rows[form]["MUFU"].split()
        assert name == op and int(count) % 16 == 0, rows[form]   # 16 values a thread, each step
