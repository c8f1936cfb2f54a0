"""model.block_chunk_size and model.offload_activations are exact (float64: same loss and every
gradient as without them), do what they promise on the CPU (no whole-sequence MLP hidden, block
inputs moved out), and refuse the combinations they do not support in one line."""
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import model.offload as offload_module
from training.builders import build_model   # the schema's checks, then model.build_model
from tests.test_memory_features import TINY, assert_same, loss_and_grads
from tests.trainrun import cache_dir, losses, run_in_process, tiny_overrides  # noqa: F401 (cache_dir: fixture)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from _memory import LiveTensorMeter  # noqa: E402

VARIANTS = {   # sequence length in loss_and_grads is 24
    "rope-gqa-swiglu": {},
    "learned-mha-gelu": {"pos_emb": "learned", "n_kv_head": 4, "norm": "layernorm", "mlp": "gelu", "bias": True},
}


@pytest.mark.parametrize("chunk", [5, 8, 24, 100])
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_block_chunks_are_exact(variant, mode, chunk):
    """Chunks that do and do not divide the 24 tokens, one chunk, and a chunk longer than the sequence."""
    changes = VARIANTS[variant]
    plain = loss_and_grads(**changes)
    assert_same(plain, loss_and_grads(activation_checkpointing=mode, block_chunk_size=chunk, **changes))


def test_block_chunks_are_exact_with_chunked_loss_and_naive_attention():
    plain = loss_and_grads("naive")
    assert_same(plain, loss_and_grads("naive", activation_checkpointing="full", block_chunk_size=7, loss_chunk_size=10))


@pytest.mark.parametrize("changes", [
    {},
    {"block_chunk_size": 7},
    {"block_chunk_size": 7, "loss_chunk_size": 10, **VARIANTS["learned-mha-gelu"]},
])
def test_offloaded_activations_are_exact(changes, monkeypatch):
    """Same loss and gradients, and every block input but the last one went to the 'host' copy."""
    offloads = []
    init = offload_module.BlockInputOffload.__init__

    def recording_init(self, device):
        init(self, device)
        offloads.append(self)

    monkeypatch.setattr(offload_module.BlockInputOffload, "__init__", recording_init)
    base = {k: v for k, v in changes.items() if k != "block_chunk_size"}
    plain = loss_and_grads(activation_checkpointing="full", **base)
    assert not offloads
    assert_same(plain, loss_and_grads(activation_checkpointing="full", offload_activations=True, **changes))
    (offload,) = offloads
    batch, seq_len, n_layer = 2, 24, TINY["n_layer"]
    assert offload.offloaded_bytes == (n_layer - 1) * batch * seq_len * TINY["d_model"] * 8


def _block_inputs_alive_after_forward(**changes):
    """How many of the block inputs are still alive between forward and backward."""
    torch.manual_seed(0)
    model = build_model({**TINY, "n_layer": 3, "activation_checkpointing": "full", **changes},
                        vocab_size=50, attention="sdpa")
    inputs = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _, args: inputs.append(weakref.ref(args[0])))
    idx = torch.randint(0, 50, (1, 32))
    loss = model(idx, idx)
    alive = sum(ref() is not None for ref in inputs)
    loss.backward()
    return alive


def test_offload_lets_go_of_the_block_inputs():
    """Full checkpointing holds every block's input; offloaded, only the last block's stays."""
    assert _block_inputs_alive_after_forward() == 3
    assert _block_inputs_alive_after_forward(offload_activations=True) == 1


class LargestRows(TorchDispatchMode):
    """Largest number of rows (elements / last dim) of any tensor created whose last dim is `width`."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.rows = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.width:
                self.rows = max(self.rows, t.numel() // self.width)
        return out


def _step_under(mode, seq_len=256, **changes):
    torch.manual_seed(0)
    model = build_model({**TINY, "n_layer": 2, "max_seq_len": seq_len, "mlp": "gelu", "d_ff": 96, **changes},
                        vocab_size=50, attention="sdpa")
    idx = torch.randint(0, 50, (1, seq_len))
    with mode:
        model(idx, idx).backward()
    return mode


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_mlp_hidden_never_spans_the_sequence(checkpointing):
    """The MLP's d_ff-wide hidden is made for the whole sequence without chunks (also while full
    checkpointing recomputes the block in backward), and for at most one chunk with them; the
    live-tensor peak of the whole step drops accordingly."""
    whole = _step_under(LargestRows(96), activation_checkpointing=checkpointing)
    chunked = _step_under(LargestRows(96), activation_checkpointing=checkpointing, block_chunk_size=32)
    assert whole.rows == 256
    assert chunked.rows == 32
    peak_whole = _step_under(LiveTensorMeter(), activation_checkpointing=checkpointing).peak
    peak_chunked = _step_under(LiveTensorMeter(), activation_checkpointing=checkpointing, block_chunk_size=32).peak
    mlp_hidden = 256 * 96 * 4   # one float32 (T, d_ff) tensor
    assert peak_chunked < peak_whole - mlp_hidden


@pytest.mark.parametrize("change, message", [
    ({"block_chunk_size": -1}, "model.block_chunk_size=-1: must be an integer >= 0"),
    ({"block_chunk_size": 8}, "model.block_chunk_size=8 needs model.activation_checkpointing=full or selective"),
    ({"block_chunk_size": 8, "activation_checkpointing": "full", "dropout": 0.1},
     "model.block_chunk_size=8 with model.dropout=0.1"),
    ({"block_chunk_size": 2.5}, "model.block_chunk_size=2.5: must be an integer"),
    ({"offload_activations": True}, "model.offload_activations=true needs model.activation_checkpointing=full"),
    ({"offload_activations": True, "activation_checkpointing": "selective"}, "got 'selective'"),
    ({"offload_activations": "maybe"}, "model.offload_activations='maybe': must be true or false"),
])
def test_bad_memory_feature_config_is_one_clear_error(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_model({**TINY, **change}, vocab_size=50, attention="sdpa")


def test_chunked_blocks_compile_without_graph_breaks():
    torch.manual_seed(0)
    model = build_model({**TINY, "activation_checkpointing": "full", "block_chunk_size": 8},
                        vocab_size=50, attention="sdpa")
    idx = torch.randint(0, 50, (2, 16))
    explanation = torch._dynamo.explain(model)(idx, idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_max_context_runs_the_new_feature_sets_on_a_cpu_budget(tmp_path):
    """Block chunks fit longer steps in the same budget (a wide MLP, as at scale); the table reports
    time per token, the per-token memory slope and the length where that line meets the budget.
    (Offloading is not searched here: on the CPU the 'host' copy is in the same memory.)"""
    import max_context

    overrides = ["model.vocab_size=256", "model.n_layer=2", "model.d_model=32", "model.n_head=4",
                 "model.n_kv_head=4", "model.mlp=gelu", "model.d_ff=512",
                 "features=[ckpt+chunked,ckpt+chunked+blockchunk]",
                 "start=256", "granularity=256", "cap=2048", "memory_budget_mb=6",
                 "device=cpu"]
    torch.set_num_threads(1)
    try:
        cfg = max_context.compose_config(overrides, ["sdpa"], tmp_path, "mc")
        for features in cfg.features:   # CPU-sized chunks
            cfg.feature_sets[features].loss_chunk_size = 64
            if "block_chunk_size" in cfg.feature_sets[features]:
                cfg.feature_sets[features].block_chunk_size = 128
        report = max_context.run(cfg)
    finally:
        torch.set_num_threads(2)
    found = {r["features"]: r for r in report["results"]}
    assert all(r["error"] is None for r in found.values())
    assert 0 < found["ckpt+chunked"]["max_length"] < found["ckpt+chunked+blockchunk"]["max_length"]
    slopes = {name: max_context.memory_line(r["probes"])[0] for name, r in found.items()}
    assert 0 < slopes["ckpt+chunked+blockchunk"] < slopes["ckpt+chunked"] / 2
    table = (tmp_path / "mc.md").read_text()
    assert "| µs/token | bytes/token | linear max |" in table


def test_memory_line_and_its_predicted_maximum():
    probes = [{"length": n, "fits": True, "peak_bytes": 1000 + 10 * n} for n in (256, 512, 1024)]
    probes.append({"length": 2048, "fits": False, "peak_bytes": None})
    line = max_context_module().memory_line(probes)
    assert line == (10.0, 1000.0)
    assert max_context_module().predicted_max(line, 1000 + 10 * 5000, 256) == 4864
    assert max_context_module().memory_line(probes[:1]) is None
    assert max_context_module().predicted_max(None, 10**9, 256) is None


def max_context_module():
    import max_context
    return max_context


def test_block_chunks_split_per_sequence_positions():
    """RoPE tables of shape (B, T, D/2) (positions given per sequence) are split along T too."""
    def loss_and_grads_at(positions, **changes):
        torch.manual_seed(0)
        model = build_model({**TINY, "activation_checkpointing": "full", **changes}, vocab_size=50,
                            attention="sdpa").double()
        idx = torch.randint(0, 50, (2, 24))
        loss = model(idx, idx, positions=positions)
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    positions = torch.stack([torch.arange(24), torch.arange(100, 124)])
    assert_same(loss_and_grads_at(positions), loss_and_grads_at(positions, block_chunk_size=5))


def test_train_runs_with_both_features(tmp_path, cache_dir):
    """train.py end to end: the same losses and gradient norms as full checkpointing alone."""
    base = ["model.activation_checkpointing=full", "model.loss_chunk_size=16"]
    runs = {}
    for name, extra in (("plain", []), ("both", ["model.block_chunk_size=24", "model.offload_activations=true"])):
        assert run_in_process(tiny_overrides(tmp_path / name, cache_dir, steps=3) + base + extra) == 0
        runs[name] = losses(tmp_path / name)
    assert len(runs["plain"]) == 3
    for plain, both in zip(runs["plain"], runs["both"]):
        assert plain[0] == both[0]
        # val_loss is None on steps without an evaluation, in both runs alike
        assert both[1:] == tuple(x if x is None else pytest.approx(x, rel=1e-5) for x in plain[1:])


def test_compiling_with_offload_compiles_each_block():
    """The saved-tensor hooks sit between blocks, so TrainStep compiles the blocks one by one."""
    from training.config import compose
    from training.builders import model_from_config
    from training.loop.step import TrainStep

    cfg = compose(["model.n_layer=2", "model.activation_checkpointing=full", "model.offload_activations=true",
                   "trainer.compile=true"])
    model = model_from_config(cfg, 64, attention="sdpa")
    step = TrainStep(model, cfg, torch.device("cpu"))
    assert step.forward is model
    assert all("forward" in vars(block) for block in model.blocks)   # replaced by the compiled one


def test_offloaded_backward_holds_no_block_input_of_the_forward():
    """When the first block is recomputed in backward, none of the forward's block inputs is
    alive any more (the top one is released after its own backward), only fetched copies."""
    torch.manual_seed(0)
    model = build_model({**TINY, "n_layer": 3, "activation_checkpointing": "full", "offload_activations": True},
                        vocab_size=50, attention="sdpa")
    inputs, alive_at_first_block = [], []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _, args: inputs.append(weakref.ref(args[0])))

    def count(_, args):
        if len(inputs) == 3:   # the recomputation in backward, not the forward
            alive_at_first_block.append(sum(ref() is not None for ref in inputs))

    model.blocks[0].norm_attn.register_forward_pre_hook(count)
    idx = torch.randint(0, 50, (1, 32))
    model(idx, idx).backward()
    assert alive_at_first_block == [0]


def test_each_offloaded_input_is_fetched_before_its_block_needs_it(monkeypatch):
    """Unpacking block i's input starts fetching block i-1's (the top block's starts the chain), so
    every copy back is under way while the block above is differentiated."""
    events = []
    fetch, unpack = offload_module.BlockInputOffload._fetch, offload_module.BlockInputOffload._unpack

    def recording_fetch(self, stored):
        events.append(("fetch", id(stored)))
        fetch(self, stored)

    def recording_unpack(self, stored):
        if isinstance(stored, offload_module._Stored):
            events.append(("unpack", id(stored)))
        return unpack(self, stored)

    monkeypatch.setattr(offload_module.BlockInputOffload, "_fetch", recording_fetch)
    monkeypatch.setattr(offload_module.BlockInputOffload, "_unpack", recording_unpack)
    loss_and_grads(activation_checkpointing="full", offload_activations=True, n_layer=4)
    unpacked = [key for kind, key in events if kind == "unpack"]
    assert len(unpacked) == 4
    for above, key in zip(unpacked, unpacked[1:]):   # the offloaded three: each fetched one block ahead
        assert events.index(("fetch", key)) == events.index(("unpack", above)) + 1


def test_partial_steps_measure_the_peak_of_whole_steps(tmp_path):
    """partial_step=true stops after the top block's backward; under checkpointing its peak is the
    whole step's (a little above: every gradient is allocated from the start), and it is not timed."""
    import max_context

    peaks = {}
    for partial in (False, True):
        cfg = max_context.compose_config([
            "model.vocab_size=256", "model.n_layer=3", "model.d_model=32", "model.n_head=4", "model.n_kv_head=4",
            "features=[ckpt+chunked,ckpt+chunked+blockchunk]", "start=256", "granularity=256",
            "cap=512", "memory_budget_mb=100", "device=cpu", f"partial_step={partial}"], ["sdpa"], tmp_path, f"p{partial}")
        cfg.feature_sets["ckpt+chunked+blockchunk"].block_chunk_size = 128
        report = max_context.run(cfg)
        peaks[partial] = [p["peak_bytes"] for r in report["results"] for p in r["probes"]]
        assert all((p["step_s"] is None) == partial for r in report["results"] for p in r["probes"])
    assert len(peaks[True]) == len(peaks[False]) == 4
    for whole, partial in zip(peaks[False], peaks[True]):
        assert whole <= partial < 1.2 * whole
    assert "Partial steps" in (tmp_path / "pTrue.md").read_text()


@pytest.mark.parametrize("override, message", [
    ("trainer.compile=true", "partial_step=true with trainer.compile=true"),
    ("features=[plain]", "partial_step=true needs activation checkpointing"),
])
def test_partial_step_refusals(override, message):
    import max_context

    cfg = max_context.compose_config(["model.vocab_size=256", "memory_budget_mb=8", "device=cpu",
                                      "features=[ckpt+chunked]", "partial_step=true", override], ["sdpa"])
    with pytest.raises(ValueError, match=message):
        max_context.validate(cfg, torch.device("cpu"))
