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


def test_partial_rope_keeps_the_slowest_pairs_still():
    """rotated_pairs=r: the fastest r pairs carry the full table's angles, the rest cos 1 and sin 0,
    so the channels of those pairs (i and i + D/2, rotate-half layout) come out of apply_rope as
    they went in, and their part of a query-key product is the same at any distance."""
    positions = torch.tensor([0, 3, 4095, 1_048_575])
    cos, sin = rope_table(positions, 64, 500000.0, 24)
    full_cos, full_sin = rope_table(positions, 64, 500000.0)
    assert torch.equal(cos[:, :24], full_cos[:, :24]) and torch.equal(sin[:, :24], full_sin[:, :24])
    assert torch.equal(cos[:, 24:], torch.ones(4, 8)) and torch.equal(sin[:, 24:], torch.zeros(4, 8))
    still = torch.cat([torch.arange(24, 32), torch.arange(56, 64)])
    x = torch.randn(1, 4, 2, 64)   # float32: apply_rope's own arithmetic, so x cos - y 0 is x exactly
    rotated = apply_rope(x, cos, sin)
    assert torch.equal(rotated[..., still], x[..., still])
    assert not torch.allclose(rotated[:, 1:, :, :24], x[:, 1:, :, :24])   # the others do turn
    q, k = torch.zeros(1, 4, 1, 64), torch.zeros(1, 4, 1, 64)
    q[..., still], k[..., still] = torch.randn(16), torch.randn(16)
    scores = apply_rope(q, cos, sin)[0, :, 0] @ apply_rope(k, cos, sin)[0, :, 0].T
    assert torch.equal(scores, torch.full_like(scores, scores[0, 0].item()))   # 4 positions, 16 distances, one value


def test_rope_fraction_builds_the_model_with_that_table_and_refuses_what_does_not_fit():
    """model.rope_fraction reaches the table the blocks rotate with; a fraction that is not a
    whole number of pairs, or on learned positions, is refused in one line naming it."""
    import pytest

    torch.manual_seed(0)
    options = dict(n_layer=2, n_head=2, n_kv_head=2, d_model=32, rope_theta=10000.0)   # head dim 16: 8 pairs
    full = build_model(options, vocab_size=64, attention="naive")
    partial = build_model(dict(options, rope_fraction=0.75), vocab_size=64, attention="naive")
    partial.load_state_dict(full.state_dict())
    assert partial.config.rotated_pairs == 6 and full.config.rotated_pairs is None
    _, table = partial._embed(torch.zeros(1, 5, dtype=torch.long), torch.arange(5))
    torch.testing.assert_close(table[0], rope_table(torch.arange(5), 16, 10000.0, 6)[0])
    x = torch.randint(0, 64, (2, 12))
    assert not torch.allclose(partial(x), full(x))            # the same weights, another function
    none = build_model(dict(options, rope_fraction=0.0), vocab_size=64, attention="naive")   # no rotation (NoPE)
    _, table = none._embed(torch.zeros(1, 5, dtype=torch.long), torch.arange(5))
    assert none.config.rotated_pairs == 0 and torch.equal(table[0], torch.ones(5, 8)) and not table[1].any()
    with pytest.raises(ValueError, match=r"model.rope_fraction=0.3: must rotate a whole number of the 8 RoPE pairs .*1/8"):
        build_model(dict(options, rope_fraction=0.3), vocab_size=64, attention="naive")
    with pytest.raises(ValueError, match="model.rope_fraction=0.5: needs model.pos_emb=rope"):
        build_model(dict(options, rope_fraction=0.5, pos_emb="learned"), vocab_size=64, attention="naive")
