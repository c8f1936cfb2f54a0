"""The GPT: shapes, causality, parameter counts per preset, FLOPs/MFU, config errors."""
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from model import GPT, GPTConfig
from training.builders import build_model   # the schema's checks, then model.build_model
from training.loop.throughput import mfu

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = dict(name="t", n_layer=2, n_head=4, n_kv_head=2, d_model=32, vocab_size=None, max_seq_len=64)


def compose_model(*overrides):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return compose(config_name="train", overrides=list(overrides)).model


def tiny(**changes):
    torch.manual_seed(0)
    return build_model({**TINY, **changes}, vocab_size=50, attention="sdpa")


def test_shapes_and_vocab_rounding():
    model = tiny()
    assert model.config.vocab_size == 64           # 50 rounded up to a multiple of 64
    idx = torch.randint(0, 50, (3, 10))
    assert model(idx).shape == (3, 10, 64)
    loss = model(idx, idx)
    assert loss.shape == () and torch.isfinite(loss)


def test_loss_is_cross_entropy_of_logits_ignoring_minus_100():
    model = tiny()
    idx = torch.randint(0, 50, (2, 12))
    targets = torch.randint(0, 50, (2, 12))
    targets[0, :5] = -100
    logits = model(idx)
    keep = targets != -100
    want = -torch.log_softmax(logits, -1)[keep].gather(1, targets[keep][:, None]).mean()
    torch.testing.assert_close(model(idx, targets), want)


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_causal_future_tokens_do_not_change_past_outputs(pos_emb, attention):
    torch.manual_seed(0)
    model = build_model({**TINY, "pos_emb": pos_emb}, vocab_size=50, attention=attention).double()
    idx = torch.randint(0, 50, (2, 16))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 50
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-12)
    assert (a[:, 9] - b[:, 9]).abs().max() > 1e-4    # the changed position itself does see it


@pytest.mark.parametrize("attention", ["naive", "sdpa", "flash"])
def test_attention_dropout_acts_in_training_only(attention):
    """Every attention drops probabilities in training (flash: in its tiles; float32 in Triton's
    interpreter on a CPU) and none in eval mode."""
    device, dtype = ("cuda" if torch.cuda.is_available() else "cpu", torch.float32) if attention == "flash" \
        else ("cpu", torch.float64)
    idx = torch.randint(0, 50, (2, 16), device=device)
    torch.manual_seed(0)
    exact = build_model(TINY, vocab_size=50, attention=attention).to(device, dtype)
    torch.manual_seed(0)
    dropping = build_model({**TINY, "attention_dropout": 0.3}, vocab_size=50, attention=attention).to(device, dtype)
    dropping.eval()
    torch.testing.assert_close(dropping(idx), exact(idx), rtol=0, atol=0)   # no dropout in eval mode
    dropping.train()
    a, b = dropping(idx), dropping(idx)
    assert (a - b).abs().max() > 1e-3 and (a - exact(idx)).abs().max() > 1e-3


@pytest.mark.parametrize("options", [{"attention_softcap": 1e-3}, {"attention_sinks": True},
                                     {"attention_softcap": 1e-3, "attention_sinks": True}], ids=str)
def test_softcap_and_sinks_change_the_model_and_sinks_are_trained_parameters(options):
    """A cap and sinks change the function (the initial scores are ~1e-3, so the cap bites at 1e-3;
    sinks are 0 at the start: each row's denominator gains 1),
    the sinks are one parameter per layer and head, trained (a gradient), and kept in state_dict."""
    idx = torch.randint(0, 50, (2, 16))
    torch.manual_seed(0)
    plain = build_model(TINY, vocab_size=50, attention="naive").double()
    torch.manual_seed(0)
    model = build_model({**TINY, **options}, vocab_size=50, attention="naive").double()
    model.load_state_dict(plain.state_dict(), strict=False)
    assert (model(idx) - plain(idx)).abs().max() > 1e-4
    sinks = [name for name in model.state_dict() if name.endswith("attn.sinks")]
    assert len(sinks) == (TINY["n_layer"] if options.get("attention_sinks") else 0)
    if sinks:
        model(idx, idx).backward()
        grads = [block.attn.sinks.grad for block in model.blocks]
        assert all(g.shape == (TINY["n_head"],) and g.abs().max() > 0 for g in grads)
        assert model.num_params() == plain.num_params() + TINY["n_layer"] * TINY["n_head"]


@pytest.mark.parametrize("options, match", [
    ({"attention_softcap": 30.0}, r"model.attention_softcap=30.0 needs attention=naive or flash "
                                  r"\(attention=sdpa has no logit soft-capping\)"),
    ({"attention_sinks": True}, r"model.attention_sinks=true needs attention=naive or flash "
                                r"\(attention=sdpa has no attention sinks\)"),
])
def test_sdpa_refuses_softcap_and_sinks(options, match):
    with pytest.raises(ValueError, match=match):
        build_model({**TINY, **options}, vocab_size=50, attention="sdpa")


def test_a_dropout_our_kernel_would_round_away_is_refused_when_the_model_is_built():
    """attention=flash draws dropout in steps of 1/256 (kernels/scores.py); sdpa and naive take any p."""
    with pytest.raises(ValueError, match=r"model.attention_dropout=0.001: attention=flash draws it in steps of 1/256"):
        build_model({**TINY, "attention_dropout": 0.001}, vocab_size=50, attention="flash")
    for attention in ("sdpa", "naive"):
        build_model({**TINY, "attention_dropout": 0.001}, vocab_size=50, attention=attention)
    build_model({**TINY, "attention_dropout": 0.1}, vocab_size=50, attention="flash")


def test_naive_and_sdpa_models_agree_in_float64():
    torch.manual_seed(0)
    naive = build_model(TINY, vocab_size=50, attention="naive").double()
    sdpa = build_model(TINY, vocab_size=50, attention="sdpa").double()
    sdpa.load_state_dict(naive.state_dict())
    idx = torch.randint(0, 50, (2, 16))
    torch.testing.assert_close(sdpa(idx), naive(idx), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
def test_positions_matter(pos_emb):
    """Without position information, causal attention at the last token would be a function
    of the set of earlier tokens: permuting them would not change its output (one layer,
    so earlier positions' outputs cannot carry order either)."""
    model = tiny(pos_emb=pos_emb, n_layer=1).double()
    idx = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])
    permuted = idx[:, [4, 2, 6, 0, 1, 5, 3, 7]]
    assert (model(idx)[0, -1] - model(permuted)[0, -1]).abs().amax() > 1e-6   # ~1e-17 with RoPE disabled


def test_learned_positions_add_a_table_rope_does_not():
    rope, learned = tiny(pos_emb="rope"), tiny(pos_emb="learned")
    assert learned.num_params() - rope.num_params() == TINY["max_seq_len"] * TINY["d_model"]
    assert rope.num_params(exclude_embeddings=True) == learned.num_params(exclude_embeddings=True)


def test_tied_and_untied_heads():
    tied, untied = tiny(tie_embeddings=True), tiny(tie_embeddings=False)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 64 * TINY["d_model"]
    assert untied.num_params(exclude_embeddings=True) == tied.num_params(exclude_embeddings=True)


def test_gpt2_init_scales_residual_projections():
    torch.manual_seed(0)
    model = build_model({**TINY, "n_layer": 8, "d_model": 256}, vocab_size=50, attention="sdpa")
    block = model.blocks[0]
    assert abs(block.attn.qkv.weight.std().item() - 0.02) < 0.002
    assert abs(block.mlp.proj.weight.std().item() - 0.02 / 4) < 0.0005   # 1/sqrt(2 * 8)


def _count(*overrides, vocab_size):
    with torch.device("meta"):
        return build_model(compose_model(*overrides), vocab_size=vocab_size, attention="sdpa")


def test_gpt2_small_matches_gpt2_parameter_count():
    gpt2 = ("model=gpt2-small", "model.pos_emb=learned", "model.bias=true",
            "model.max_seq_len=1024", "model.vocab_size=50257")
    assert _count(*gpt2, vocab_size=50257).num_params() == 124_439_808


def test_gpt2_medium_matches_gpt2_parameter_count():
    gpt2 = ("model=gpt2-medium", "model.pos_emb=learned", "model.bias=true",
            "model.max_seq_len=1024", "model.vocab_size=50257")
    assert _count(*gpt2, vocab_size=50257).num_params() == 354_823_168


@pytest.mark.parametrize("preset, total, non_embedding", [
    ("tiny", 820_352, 787_584),                      # byte tokenizer: 256 tokens
    ("gpt2-small", 123_587_328, 84_953_856),
    ("gpt2-medium", 353_551_360, 302_040_064),
    ("gpt-1b", 1_319_733_248, 1_113_688_064),
])
def test_preset_parameter_counts(preset, total, non_embedding):
    model = _count(f"model={preset}", vocab_size=256 if preset == "tiny" else 50257)
    assert model.num_params() == total
    assert model.num_params(exclude_embeddings=True) == non_embedding
    c = model.config
    ff_matrices = 3 if c.mlp == "swiglu" else 2
    per_layer = c.d_model * (c.n_head + 2 * c.n_kv_head) * c.head_dim + c.d_model ** 2 + ff_matrices * c.d_model * c.d_ff
    assert non_embedding - c.n_layer * per_layer < 0.01 * non_embedding   # the rest is norms


def test_flops_per_token_formula():
    model = tiny()
    c = model.config
    n_matmul = model.num_params(exclude_embeddings=True) + c.vocab_size * c.d_model
    assert model.flops_per_token(64) == 6 * n_matmul + 6 * c.n_layer * c.d_model * 64
    assert model.flops_per_token(128) - model.flops_per_token(64) == 6 * c.n_layer * c.d_model * 64
    assert mfu(1000.0, model.flops_per_token(64), peak=model.flops_per_token(64) * 4000) == pytest.approx(0.25)


def test_gpt2_small_flops_near_nanogpt_estimate():
    """nanoGPT: 6N + 12*L*d*T with N = 124M; ours halves the causal attention term."""
    model = _count("model=gpt2-small", vocab_size=50257)
    nanogpt_like = 6 * 124e6 + 12 * 12 * 768 * 1024 / 2
    assert model.flops_per_token(1024) == pytest.approx(nanogpt_like, rel=0.01)


@pytest.mark.parametrize("change, message", [
    ({"d_model": 30}, "d_model=30 is not divisible by model.n_head=4"),
    ({"n_kv_head": 3}, "n_head=4 is not divisible by model.n_kv_head=3"),
    ({"d_model": 12, "n_head": 4, "n_kv_head": 4}, "RoPE needs an even head dim"),
    ({"vocab_size": 40}, "vocab_size=40 is smaller than the tokenizer's 50"),
    ({"norm": "batchnorm"}, "model.norm='batchnorm': expected one of rmsnorm, layernorm"),
    ({"mlp": "relu"}, "model.mlp='relu': expected one of swiglu, gelu"),
    ({"pos_emb": "alibi"}, "model.pos_emb='alibi': expected one of rope, learned"),
    ({"activation_checkpointing": "some"}, "activation_checkpointing='some': expected one of none, full, selective"),
    ({"loss_chunk_size": -1}, "loss_chunk_size=-1: must be an integer >= 0"),
    ({"n_layer": 0}, "n_layer=0: must be a positive integer"),
    ({"dropout": 1.0}, "dropout=1.0: must be a number in"),
    ({"n_layers": 2}, "unknown config key 'model.n_layers'"),
])
def test_bad_config_is_one_clear_error(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_model({**TINY, **change}, vocab_size=50, attention="sdpa")


def test_odd_head_dim_is_fine_with_learned_positions():
    """RoPE refuses an odd head dim (test_bad_config_is_one_clear_error); learned positions take it."""
    model = tiny(d_model=12, n_head=4, n_kv_head=4, pos_emb="learned")
    assert model.config.d_model // model.config.n_head == 3
    idx = torch.randint(0, 50, (2, 8))
    assert model(idx).shape == (2, 8, 64) and torch.isfinite(model(idx, idx))


def test_unknown_attention_is_rejected():
    with pytest.raises(ValueError, match="attention 'auto' is not registered"):
        build_model(TINY, vocab_size=50, attention="auto")


def test_sequence_over_max_seq_len_is_rejected():
    model = tiny()
    with pytest.raises(ValueError, match="sequence length 65 exceeds model.max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_build_accepts_composed_dictconfig_and_plain_config():
    cfg = compose_model("model=tiny")
    assert isinstance(build_model(cfg, vocab_size=256, attention="naive"), GPT)
    config = GPTConfig.from_cfg(OmegaConf.to_container(cfg), vocab_size=256)
    assert config.d_ff == 384 and config.vocab_size == 256      # 8/3 * 128 rounded to 64
