"""Config composition through Hydra's compose API, the loop's own validation, the optimizer
groups and schedule, experiment presets and a Hydra multirun sweep."""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from tests.trainrun import cache_dir, losses, run_subprocess, tiny_overrides  # noqa: F401 (cache_dir is a fixture)
from training.config import CONFIG_DIR, compose, validate_trainer
from training.optim import build_optimizer, lr_at, param_groups, validate_optim

GROUPS = ["model", "attention", "data", "tokenizer", "optim", "trainer", "logger", "experiment"]
PRESETS = [(group, path.stem) for group in GROUPS for path in sorted((CONFIG_DIR / group).glob("*.yaml"))]


def test_every_group_has_presets():
    assert {g for g, _ in PRESETS} == set(GROUPS)


@pytest.mark.parametrize("group,name", PRESETS, ids=[f"{g}={n}" for g, n in PRESETS])
def test_every_preset_composes_and_resolves(group, name):
    cfg = compose([f"{group}={name}", "run.dir=/tmp/unused"])
    # `???` marks what the user must supply (a data path, a tokenizer file): everything else resolves
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert set(container) >= {"model", "attention", "data", "tokenizer", "optim", "trainer", "logger", "seed",
                              "device", "resume", "run"}
    if group == "experiment":
        assert cfg.run.name == name
    elif group in ("model", "attention", "tokenizer", "optim", "logger"):
        assert cfg[group].name == name
    validate_trainer(cfg.trainer)
    validate_optim(cfg.optim)


def test_command_line_wins_over_an_experiment():
    cfg = compose(["experiment=gpt2-small-4k", "attention=naive", "trainer.seq_len=1024", "run.dir=x"])
    assert (cfg.model.name, cfg.attention.name, cfg.trainer.seq_len) == ("gpt2-small", "naive", 1024)


def test_default_run_is_the_cpu_sized_job():
    cfg = compose(["run.dir=x"])
    assert (cfg.model.name, cfg.attention.name, cfg.data.name, cfg.device, cfg.logger.name) == (
        "tiny", "auto", "stdlib", "auto", "none")


@pytest.mark.parametrize("key,value,reason", [
    ("eval_every", -1, "must be an integer >= 0"),
    ("keep_ckpts", 0, "must be a positive integer"),
    ("seq_len", 1.5, "must be a positive integer"),
    ("precision", "fp8", "expected one of auto, bf16, fp32"),
    ("compile", "yes", "must be true or false"),
    ("peak_flops", -5, "must be null"),
])
def test_trainer_validation_names_key_and_reason(key, value, reason):
    cfg = compose(["run.dir=x"])
    cfg.trainer[key] = value
    with pytest.raises(ValueError, match=rf"trainer\.{key}=.*{reason}"):
        validate_trainer(cfg.trainer)


@pytest.mark.parametrize("key,value", [("lr", 0.0), ("betas", [0.9]), ("eps", 0), ("weight_decay", -0.1),
                                       ("schedule", "linear"), ("grad_clip", -1), ("fused", "maybe"),
                                       ("name", "sgd"), ("warmup_steps", -3)])
def test_optim_validation_names_the_key(key, value):
    cfg = compose(["run.dir=x"])
    cfg.optim[key] = value
    with pytest.raises(ValueError, match=rf"optim\.{key}="):
        validate_optim(cfg.optim)


def test_warmup_then_cosine_to_min_lr():
    optim = compose(["optim.lr=1.0", "optim.min_lr=0.1", "optim.warmup_steps=10", "run.dir=x"]).optim
    lrs = [lr_at(s, optim, 110) for s in range(111)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))      # rising through warmup
    assert lrs[10] == pytest.approx(1.0)                        # peak at the end of warmup
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))      # then never rising
    assert lrs[60] == pytest.approx(0.55) and lrs[110] == pytest.approx(0.1)
    optim.schedule = "constant"
    assert lr_at(100, optim, 110) == 1.0


def test_weight_decay_hits_matrices_only():
    from model import build_model

    cfg = compose(["run.dir=x", "model.tie_embeddings=false", "model.bias=true"])
    model = build_model(cfg.model, vocab_size=257, attention="sdpa")
    decay, no_decay = param_groups(model, 0.1)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    assert decay["params"] and all(p.dim() == 2 and id(p) not in embeddings for p in decay["params"])
    assert any(id(p) in embeddings for p in no_decay["params"])
    assert any(p.dim() == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == model.num_params()
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert not optimizer.defaults["fused"]  # fused=auto is for CUDA


def test_multirun_sweep_runs_every_job(tmp_path, cache_dir):
    overrides = tiny_overrides("unused", cache_dir, steps=3)
    overrides = [o for o in overrides if not o.startswith("run.dir=")]
    result = run_subprocess(["-m", "seed=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides])
    assert result.returncode == 0, result.stderr
    jobs = [tmp_path / "sweep" / str(i) for i in range(2)]
    assert [len(losses(j)) for j in jobs] == [3, 3]
    assert losses(jobs[0]) != losses(jobs[1])  # the seeds really differ
    assert OmegaConf.load(jobs[1] / "config.yaml").seed == 2
    assert all(math.isfinite(loss) for j in jobs for _, loss, *_ in losses(j))
