"""RoPE: the table op's values, its broadcasting, and that a compiled model builds the table once."""
import torch

from training.builders import build_model   # the schema's checks, then model.build_model
from model.rope import apply_rope, rope_cos_sin, rope_table


def test_table_is_the_float64_angle_formula():
    positions = torch.tensor([0, 1, 7, 4095, 1_048_575])
    cos, sin = rope_table(positions, 64, 10000.0)
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    angles = positions.double()[:, None] * inv_freq[None, :]
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (5, 32)
    assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())


def test_per_sequence_positions_broadcast_like_a_shared_table():
    """(B, T) positions (e.g. an offset per sequence) rotate each row by its own table."""
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    positions = torch.stack([torch.arange(5), torch.arange(10, 15)])
    rotated = apply_rope(x, *rope_table(positions, 8, 10000.0))
    for b in range(2):
        alone = apply_rope(x[b:b + 1], *rope_table(positions[b], 8, 10000.0))
        torch.testing.assert_close(rotated[b:b + 1], alone)
    torch.testing.assert_close(rotated[:1], apply_rope(x[:1], *rope_cos_sin(5, 8, 10000.0, "cpu")))


def test_compiled_model_builds_the_table_once_per_forward():
    """torch.compile must see one opaque table op, not cos/sin it could fuse into (and so
    recompute in) every layer's q and k; losses and gradients match eager."""
    torch.manual_seed(0)
    model = build_model(dict(n_layer=3, n_head=4, n_kv_head=2, d_model=32), vocab_size=64, attention="sdpa")
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    eager = model(x, y)
    eager.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend=record, fullgraph=True)(x, y)
    compiled.backward()
    table_ops = [n for g in graphs for n in g.graph.nodes if "rope_cos_sin" in str(n.target)]
    assert len(graphs) == 1 and len(table_ops) == 1
    torch.testing.assert_close(compiled, eager)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g)
