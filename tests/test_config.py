"""Config composition through Hydra's compose API, the loop's own validation, the optimizer
groups and schedule, experiment presets and a Hydra multirun sweep."""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from tests.trainrun import cache_dir, losses, run_subprocess, tiny_overrides  # noqa: F401 (cache_dir is a fixture)
from training.config import CONFIG_DIR, compose
from training.config.checks import validate_config
from training.config.errors import config_error_line
from training.loop.optim import build_optimizer, lr_at, param_groups

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
    if not OmegaConf.missing_keys(cfg):  # a preset whose user input is supplied is valid as a whole
        validate_config(cfg)


@pytest.mark.parametrize("name", [n for g, n in PRESETS if g == "experiment"])
def test_every_experiment_sizes_the_vocabulary_from_its_tokenizer(name):
    """A head wider than the tokenizer's vocabulary is parameters no token trains (gpt2-small's
    50,304 rows beside an 8,192-token BPE were 32M of them)."""
    assert compose([f"experiment={name}", "run.dir=/tmp/unused"]).model.vocab_size is None


def test_command_line_wins_over_an_experiment():
    cfg = compose(["experiment=gpt2-small-4k", "attention=naive", "trainer.seq_len=1024", "run.dir=x"])
    assert (cfg.model.name, cfg.attention.name, cfg.trainer.seq_len) == ("gpt2-small", "naive", 1024)


def test_default_run_is_the_cpu_sized_job():
    cfg = compose(["run.dir=x"])
    assert (cfg.model.name, cfg.attention.name, cfg.data.name, cfg.device, cfg.logger.name) == (
        "tiny", "auto", "stdlib", "auto", "none")


COMPOSE_ERRORS = [  # checked by the schema (training/config/schema.py) while Hydra composes
    ("trainer.seq_len=1.5", "trainer.seq_len=1.5: must be a positive integer"),
    ("trainer.precision=fp8", "trainer.precision='fp8': expected one of auto, bf16, fp32"),
    ("trainer.compile=maybe", "trainer.compile='maybe': must be true or false"),
    ("optim.lr=abc", "optim.lr='abc': must be a number > 0"),
    ("optim.schedule=linear", "optim.schedule='linear': expected one of cosine, constant"),
    ("optim.name=sgd", "optim.name='sgd': expected one of adamw"),
    ("optim.betas=0.9", "optim.betas=0.9: expected two values in [0, 1)"),
    ("model.norm=batchnorm", "model.norm='batchnorm': expected one of rmsnorm, layernorm"),
    ("logger.mode=online", "unknown config key 'logger.mode'"),          # logger=none has no mode
    ("data.paths=[x]", "unknown config key 'data.paths'"),               # data=stdlib reads no paths
    ("tokenizer=bpe tokenizer.vocab_size=many", "tokenizer.vocab_size='many': must be an integer >= 258"),
    ("device=tpu", "device='tpu': expected one of auto, cpu, cuda"),
]


@pytest.mark.parametrize("overrides,line", COMPOSE_ERRORS, ids=[o for o, _ in COMPOSE_ERRORS])
def test_types_keys_and_choices_are_checked_at_composition(overrides, line):
    with pytest.raises(Exception) as info:
        compose([*overrides.split(), "run.dir=x"])
    assert config_error_line(info.value).startswith(line)


RANGE_ERRORS = [  # checked by training.config.checks.validate_config once the config is final
    ("trainer.eval_every", -1, "trainer.eval_every=-1: must be an integer >= 0"),
    ("trainer.keep_ckpts", 0, "trainer.keep_ckpts=0: must be a positive integer"),
    ("trainer.peak_flops", -5, "trainer.peak_flops=-5.0: must be null or a number > 0"),
    ("trainer.context_parallel", 0, "trainer.context_parallel=0: must be a positive integer"),
    ("optim.lr", 0.0, "optim.lr=0.0: must be a number > 0"),
    ("optim.min_lr", 0.5, "optim.min_lr=0.5: must lie in [0, optim.lr=0.001]"),
    ("optim.betas", [0.9], "optim.betas=[0.9]: expected two values in [0, 1)"),
    ("optim.eps", 0, "optim.eps=0.0: must be a number > 0"),
    ("optim.weight_decay", -0.1, "optim.weight_decay=-0.1: must be a number >= 0"),
    ("optim.grad_clip", -1, "optim.grad_clip=-1.0: must be a number >= 0"),
    ("optim.fused", "maybe", "optim.fused='maybe': expected auto, true or false"),
    ("optim.warmup_steps", -3, "optim.warmup_steps=-3: must be an integer >= 0"),
    ("model.dropout", 1.0, "model.dropout=1.0: must be a number in [0, 1)"),
    ("model.d_model", 30, "model.d_model=30 is not divisible by model.n_head=4"),
    ("model.n_kv_head", 3, "model.n_head=4 is not divisible by model.n_kv_head=3"),
    ("model.block_chunk_size", -1, "model.block_chunk_size=-1: must be an integer >= 0"),
    ("attention.window", 0, "attention.window=0: must be null or a positive integer"),
    ("data.val_fraction", 1.0, "data.val_fraction=1.0: must be a number in [0, 1)"),
    ("data.max_bytes", 0, "data.max_bytes=0: must be null or a positive integer"),
    ("resume", "", "resume='': expected null, auto, continue or a checkpoint path"),
    ("seed", "x", "seed='x': must be an integer"),
]


@pytest.mark.parametrize("key,value,line", RANGE_ERRORS, ids=[k for k, _, _ in RANGE_ERRORS])
def test_ranges_and_cross_checks_name_the_key(key, value, line):
    cfg = compose(["run.dir=x"])
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ValueError) as info:
        validate_config(cfg)
    assert str(info.value).startswith(line)


def test_a_key_added_with_plus_is_still_unknown():
    """`+trainer.foo=1` gets past composition (Hydra appends it); the check of the final config
    refuses it, so no key reaches a run that no code reads."""
    cfg = compose(["+trainer.foo=1", "run.dir=x"])
    with pytest.raises(ValueError, match="unknown config key 'trainer.foo'"):
        validate_config(cfg)


def test_the_agreed_keys_are_in_the_schema_with_their_defaults():
    cfg = compose(["run.dir=x"])
    assert (cfg.trainer.context_parallel, cfg.model.offload_activations, cfg.model.block_chunk_size,
            cfg.data.document_mask, cfg.model.reset_positions, cfg.attention.window,
            cfg.attention.deterministic) == (1, False, 0, False, False, None, True)
    for option in ("naive", "sdpa", "flash"):   # one declaration for every attention option
        assert compose([f"attention={option}", "run.dir=x"]).attention.deterministic is True


def test_the_composed_config_holds_plain_values():
    """Choices are enums while composing; the config a run saves (config.yaml, checkpoints) holds
    strings, which a weights_only torch.load and yaml read back."""
    cfg = compose(["run.dir=x"])
    container = OmegaConf.to_container(cfg)
    assert type(container["trainer"]["precision"]) is str and type(container["model"]["pos_emb"]) is str


def test_warmup_then_cosine_to_min_lr():
    optim = compose(["optim.lr=1.0", "optim.min_lr=0.1", "optim.warmup_steps=10", "run.dir=x"]).optim
    lrs = [lr_at(s, optim, 110) for s in range(111)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))      # rising through warmup
    assert lrs[10] == pytest.approx(1.0)                        # peak at the end of warmup
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))      # then never rising
    assert lrs[60] == pytest.approx(0.55) and lrs[110] == pytest.approx(0.1)
    optim.schedule = "constant"
    assert lr_at(100, optim, 110) == 1.0


def test_weight_decay_hits_matrices_only_and_embeddings_unless_told_not_to():
    from training.builders import build_model   # the schema's checks, then model.build_model

    cfg = compose(["run.dir=x", "model.tie_embeddings=false", "model.bias=true", "model.pos_emb=learned",
                   "model.max_seq_len=256", "optim.decay_embeddings=false"])
    model = build_model(cfg.model, vocab_size=257, attention="sdpa")
    decay, no_decay = param_groups(model, 0.1, decay_embeddings=False)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    assert decay["params"] and all(p.dim() == 2 and id(p) not in embeddings for p in decay["params"])
    assert any(id(p) in embeddings for p in no_decay["params"])
    assert any(p.dim() == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == model.num_params()
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(decay["params"]), len(no_decay["params"])]
    assert not optimizer.defaults["fused"]  # fused=auto is for CUDA
    # The default (nanoGPT's grouping): every 2-D tensor decays, the token and position tables too.
    assert compose(["run.dir=x"]).optim.decay_embeddings is True
    decay, no_decay = param_groups(model, 0.1)
    assert embeddings <= {id(p) for p in decay["params"]} and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["params"] and all(p.dim() == 1 for p in no_decay["params"])


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


def test_a_sweep_is_checked_job_by_job_for_combinations_no_value_breaks_alone():
    """Each value below is valid with the other sweep at its first value; one job combines two that
    are not (a window longer than the model's table). A sweep of up to CHECKED_JOBS jobs has each
    job's config checked, so that one is refused, naming both values, before any job runs; a larger
    sweep still has each of its values checked once."""
    from training.config import CHECKED_JOBS, check_sweep, composed_variants, sweep_variants

    sweep = ["model.max_seq_len=512,128", "trainer.seq_len=64,256"]
    assert [swept for _, swept in sweep_variants(sweep)] == [
        None, "trainer.seq_len=256", "model.max_seq_len=128", "model.max_seq_len=128 trainer.seq_len=256"]
    assert check_sweep(composed_variants(sweep)) == (
        "trainer.seq_len=256: exceeds model.max_seq_len=128 of model 'tiny' (the sweep's job with "
        "model.max_seq_len=128 trainer.seq_len=256; no job has run)")
    large = [f"seed={','.join(str(i) for i in range(CHECKED_JOBS))}", "trainer.seq_len=64,128"]
    assert [swept for _, swept in sweep_variants(large)][-1] == "trainer.seq_len=128"
    assert len(sweep_variants(large)) == CHECKED_JOBS + 1


def test_a_checkpoint_from_before_a_new_model_key_still_resumes():
    """Checkpoints store the model config they were trained with; one written before a key joined
    the schema (model.reset_positions, ...) compares as if it had held the key's default."""
    from training.run.resume import check_model_config
    from training.run.store import CheckpointError

    current = OmegaConf.to_container(compose(["run.dir=x"]).model)
    saved = {k: v for k, v in current.items() if k not in ("offload_activations", "block_chunk_size", "reset_positions")}
    check_model_config("old.pt", saved, current)
    with pytest.raises(CheckpointError, match="model.reset_positions=False in checkpoint, True now"):
        check_model_config("old.pt", saved, {**current, "reset_positions": True})


def test_a_preset_with_a_misspelt_key_fails_composition(tmp_path, monkeypatch):
    """Presets are checked against the schema too: a typo in a YAML file (here an experiment's
    `trainer.eval_evry`) is refused while composing, instead of becoming a key no code reads."""
    import shutil

    import training.config

    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    (configs / "experiment" / "typo.yaml").write_text("# @package _global_\ntrainer:\n  eval_evry: 10\n")
    (configs / "data" / "typo.yaml").write_text("defaults:\n  - stdlib\n  - _self_\nmax_byte: 5\n")
    monkeypatch.setattr(training.config, "CONFIG_DIR", configs)
    for option, key in (("experiment/typo", "trainer.eval_evry"), ("data/typo", "data.max_byte")):
        with pytest.raises(Exception) as info:
            compose([option.replace("/", "="), "run.dir=x"])
        assert config_error_line(info.value).startswith(f"unknown config key '{key}' in configs/{option}.yaml")


def test_the_line_names_the_key_and_preset_whatever_hydras_wording(tmp_path, monkeypatch):
    """The one line comes from the exceptions' types and what Hydra was composing, not from its
    message text: with every message in the chain reworded, the line is the same."""
    import shutil

    import training.config

    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    (configs / "experiment" / "typo.yaml").write_text("# @package _global_\ntrainer:\n  eval_evry: 10\n")
    monkeypatch.setattr(training.config, "CONFIG_DIR", configs)
    for overrides, line in ((["experiment=typo"], "unknown config key 'trainer.eval_evry' in configs/experiment/typo.yaml"),
                            (["trainer.foo.bar=1"], "unknown config key 'trainer.foo.bar' (`python train.py"),
                            (["experiment=typo", "trainer.seq_len=x"], "unknown config key 'trainer.eval_evry' in")):
        with pytest.raises(Exception) as info:
            compose([*overrides, "run.dir=x"])
        for exc in (info.value, info.value.__cause__, info.value.__context__):
            if exc is not None:
                exc.args = ("Hydra said this another way",)
        assert "another way" in str(info.value) and config_error_line(info.value).startswith(line), overrides
