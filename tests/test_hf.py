"""Hugging Face interop: export to GPT-2 / Llama folders and import from them, logits equal both ways.

`transformers` is a test-only dependency (the `dev` extra); tiny random models are built
locally, nothing is downloaded.
"""
import json
import subprocess
import sys

import pytest
import torch

from data.tokenizer import ByteTokenizer, JsonTokenizer, train_bpe
from training.builders import build_model   # the schema's checks, then model.build_model
from tests.trainrun import REPO, cache_dir, run_in_process, subprocess_env, tiny_overrides, train_command  # noqa: F401 (cache_dir: fixture)
from training.interop.huggingface import export_hf, hf_architecture, tokenizer_json_text

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(REPO / "scripts"))

import export_hf as export_script  # noqa: E402

TEXT = "héllo wörld 🙂\ndef f(x):\n\treturn  x + 1  # done"
GPT2_OPTIONS = dict(pos_emb="learned", norm="layernorm", mlp="gelu", n_kv_head=4)
LLAMA_OPTIONS = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2)


def ours(**options):
    torch.manual_seed(0)
    scores = {"attention_softcap", "attention_sinks"} & options.keys()   # what SDPA cannot compute
    model = build_model(dict(name="t", n_layer=2, n_head=4, d_model=64, max_seq_len=64, **options), 257,
                        "naive" if scores else "sdpa")
    with torch.no_grad():   # biases and norm weights away from their 0 / 1 init, so a mix-up shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def hf_logits(folder, idx):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return type(model).__name__, model(idx).logits


@pytest.mark.parametrize("options,arch", [
    (dict(GPT2_OPTIONS, bias=True), "GPT2LMHeadModel"),
    (dict(GPT2_OPTIONS, bias=False, tie_embeddings=False), "GPT2LMHeadModel"),   # zero biases
    (LLAMA_OPTIONS, "LlamaForCausalLM"),                                        # GQA, tied
    (dict(LLAMA_OPTIONS, bias=True, tie_embeddings=False, rope_theta=500.0, norm_eps=1e-6), "LlamaForCausalLM"),
])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, options, arch):
    model = ours(**options)
    export_hf(model, ByteTokenizer(), tmp_path)
    idx = torch.randint(0, 257, (2, 48))
    name, logits = hf_logits(tmp_path, idx)
    assert name == arch
    with torch.no_grad():
        torch.testing.assert_close(logits, model(idx), rtol=0, atol=2e-5)


@pytest.mark.parametrize("options,message", [
    (dict(LLAMA_OPTIONS, norm="layernorm"), "model.norm='layernorm' does not map .* Llama, which needs norm=rmsnorm"),
    (dict(LLAMA_OPTIONS, mlp="gelu"), "model.mlp='gelu' does not map"),
    (dict(GPT2_OPTIONS, norm="rmsnorm"), "model.norm='rmsnorm' does not map .* GPT-2, which needs norm=layernorm"),
    (dict(GPT2_OPTIONS, n_kv_head=2), "model.n_kv_head=2 does not map"),
    (dict(LLAMA_OPTIONS, attention_softcap=30.0), "model.attention_softcap=30.0 does not map .* do not cap attention"),
    (dict(GPT2_OPTIONS, attention_sinks=True), "model.attention_sinks=True does not map .* have no attention sinks"),
    (dict(LLAMA_OPTIONS, rope_fraction=0.75), "model.rope_fraction=0.75 does not map .* rotates every RoPE pair"),
])
def test_unmappable_options_are_refused_before_writing(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        export_hf(ours(**options), ByteTokenizer(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_exported_tokenizers_encode_like_ours(tmp_path):
    bpe_path = tmp_path / "bpe" / "tokenizer.json"
    bpe_path.parent.mkdir()
    train_bpe(iter([TEXT * 20, "the quick brown fox " * 50]), 300, 2, bpe_path, show_progress=False)
    digits_path = tmp_path / "bpe-digits" / "tokenizer.json"   # tokenizer.split_digits: a pre-tokenizer sequence
    digits_path.parent.mkdir()
    train_bpe(iter([TEXT * 20, "the key is 86556 " * 50]), 300, 2, digits_path, show_progress=False, split_digits=True)
    text = TEXT + " the key is 86556, then 2048."
    for i, tokenizer in enumerate((ByteTokenizer(), JsonTokenizer(bpe_path, "bpe"), JsonTokenizer(digits_path, "bpe"))):
        folder = tmp_path / f"hf-{i}"   # not the BPE's own folder: an export replaces nothing
        export_hf(ours(**LLAMA_OPTIONS), tokenizer, folder)
        theirs = transformers.AutoTokenizer.from_pretrained(folder)
        ids = tokenizer.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ids
        assert theirs.decode(ids + [tokenizer.eot_id]) == tokenizer.decode(ids + [tokenizer.eot_id])
        assert theirs.eos_token_id == tokenizer.eot_id


def save_hf_folder(folder, kind):
    """A tiny random GPT-2 or Llama saved by transformers, with the bytes tokenizer beside it."""
    torch.manual_seed(1)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=320, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                         bos_token_id=256, eos_token_id=256)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                          rope_theta=1000.0, bos_token_id=256, eos_token_id=256)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(folder)
    from tokenizers import Tokenizer

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json_text(ByteTokenizer())),
                                               eos_token="<|endoftext|>")
    tok.save_pretrained(folder)
    return model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_init_from_starts_a_run_from_hf_weights_and_tokenizer(tmp_path, cache_dir, kind):
    from training.config import compose
    from training.loop.trainer import Trainer

    folder = tmp_path / kind
    hf_model = save_hf_folder(folder, kind)
    overrides = tiny_overrides(tmp_path / "run", cache_dir, steps=2, **{"model.init_from": str(folder)})
    run = Trainer(compose(overrides))
    run.lock.release()   # the Trainer holds the run dir; train() below takes it again
    assert run.cfg.tokenizer.name == "pretrained" and run.cfg.tokenizer.eot_token == "<|endoftext|>"
    assert hf_architecture(run.model.config) == kind and run.model.config.vocab_size == 320
    idx = torch.randint(0, 257, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(run.model.eval()(idx), hf_model(idx).logits, rtol=0, atol=2e-5)
    if kind == "llama":   # and it trains (the long-context use: max_seq_len is the run's, not HF's)
        assert run.model.config.max_seq_len == 1048576 and run.model.config.norm_eps == 1e-6
        assert run_in_process(overrides) == 0


def test_init_from_refuses_what_does_not_map(tmp_path, cache_dir, capsys):
    folder = tmp_path / "hf"
    save_hf_folder(folder, "llama")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0}
    (folder / "config.json").write_text(json.dumps(config))
    assert run_in_process(tiny_overrides(tmp_path / "run", cache_dir, **{"model.init_from": str(folder)})) == 2
    err = capsys.readouterr().err
    assert "rope_parameters={'rope_type': 'llama3'" in err and "only plain RoPE" in err
    config.update(model_type="mistral")
    (folder / "config.json").write_text(json.dumps(config))
    assert run_in_process(tiny_overrides(tmp_path / "run", cache_dir, **{"model.init_from": str(folder)})) == 2
    assert "model_type='mistral' does not map (gpt2 and llama do)" in capsys.readouterr().err


def test_export_script_on_a_trained_run(tmp_path, cache_dir):
    from training.builders import load_model_for_eval

    run_dir = tmp_path / "run"
    assert run_in_process(tiny_overrides(run_dir, cache_dir, steps=2)) == 0
    out = export_script.main([str(run_dir), str(tmp_path / "hf")])
    model, _, tokenizer = load_model_for_eval(sorted((run_dir / "checkpoints").glob("*.pt"))[-1], device="cpu")
    ids = torch.tensor([tokenizer.encode(TEXT)])
    name, logits = hf_logits(out, ids)
    assert name == "LlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids), rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="already holds model.safetensors, tokenizer.json"):
        export_script.main([str(run_dir), str(out)])
    weights = (run_dir / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="already holds model.safetensors"):   # a run's own weights stay
        export_script.main([str(run_dir), str(run_dir)])
    assert (run_dir / "model.safetensors").read_bytes() == weights and not (run_dir / "config.json").exists()
    # and back: a run started from the export computes what the trained model does
    from training.config import compose
    from training.loop.trainer import Trainer

    again = Trainer(compose(tiny_overrides(tmp_path / "again", cache_dir, **{"model.init_from": str(out)})))
    again.lock.release()
    assert again.data.tokenizer.encode(TEXT) == tokenizer.encode(TEXT)
    with torch.no_grad():
        torch.testing.assert_close(again.model.eval()(ids), model(ids), rtol=0, atol=1e-6)


def test_init_from_refuses_a_conflicting_override_and_a_torn_folder_before_work(tmp_path, cache_dir, capsys):
    """A model key given on the command line that the folder's config.json sets otherwise is refused
    (it used to vanish: the run trained at the folder's size); a torn weights file or a broken
    config.json is one line naming the file, before any data is built."""
    folder = tmp_path / "hf"
    save_hf_folder(folder, "llama")
    run = tiny_overrides(tmp_path / "run", cache_dir, **{"model.init_from": str(folder)})
    mine = [o for o in run if not o.startswith("model.n_layer=")] + ["model.n_layer=7"]
    proc = subprocess.run(train_command(mine), cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)   # train.py: Hydra knows the command line
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (f"error: model.init_from={folder}: its config.json sets "
                                                    "model.n_layer=2, the command line model.n_layer=7: drop that override")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    assert run_in_process(run) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: model.init_from={folder}: model.safetensors is unreadable (Error while deserializing "
                   "header: invalid header length)"], err
    (folder / "config.json").write_text("{broken")
    assert run_in_process(run) == 2
    assert f"{folder / 'config.json'} is not readable JSON (Expecting property name" in capsys.readouterr().err
