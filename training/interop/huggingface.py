"""Hugging Face interop: export a run to a folder `transformers` loads, start a run from one.

Two standard architectures cover the option combinations that map exactly:

- learned positions + LayerNorm + GELU (tanh) with one K/V head per query head = GPT-2
  (`GPT2LMHeadModel`). GPT-2's Conv1D layers store weights as (in, out), ours (nn.Linear) as
  (out, in): they are transposed. Its fused `c_attn` is [q; k; v] like our `qkv`. A model
  trained with bias=false exports zero biases, which computes the same function.
- RoPE + RMSNorm + SwiGLU (grouped-query attention or not) = Llama (`LlamaForCausalLM`). Both
  pair RoPE channel i with channel i + D/2 ("rotate half"), so q and k need no permutation (that
  is only needed for Meta's original interleaved checkpoints). Our fused `qkv` splits into
  q_proj, k_proj, v_proj and our fused SwiGLU `up` into [gate_proj; up_proj].

Any other combination is refused in one line naming the option. `transformers` itself is not
needed: config.json and the safetensors file are written and read directly.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from data.tokenizer import EOT_TOKEN, ByteTokenizer
from model.config import GPTConfig

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"   # save_pretrained's name when it shards
TOKENIZER_FILE = "tokenizer.json"
GPT2_GELU = ("gelu_new", "gelu_pytorch_tanh")     # both are the tanh approximation we use
# Buffers some saved models carry that hold no weights (causal masks, RoPE frequencies).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _refuse(option: str, value, why: str):
    raise ValueError(f"{option}={value!r} does not map to a Hugging Face architecture: {why}")


def hf_architecture(c: GPTConfig) -> str:
    """'gpt2' or 'llama' for a model whose options map exactly; ValueError naming the one that does not."""
    if c.attention_softcap is not None:
        _refuse("model.attention_softcap", c.attention_softcap, "gpt2 and llama do not cap attention scores")
    if c.attention_sinks:
        _refuse("model.attention_sinks", c.attention_sinks, "gpt2 and llama have no attention sinks")
    if c.rope_fraction != 1:
        _refuse("model.rope_fraction", c.rope_fraction, "llama rotates every RoPE pair")
    if c.attention_length_scale is not None:
        _refuse("model.attention_length_scale", c.attention_length_scale,
                "gpt2 and llama do not scale queries with the context length")
    if c.pos_emb == "learned":
        why = "learned positions export as GPT-2, which needs"
        if c.norm != "layernorm":
            _refuse("model.norm", c.norm, f"{why} norm=layernorm")
        if c.mlp != "gelu":
            _refuse("model.mlp", c.mlp, f"{why} mlp=gelu")
        if c.n_kv_head != c.n_head:
            _refuse("model.n_kv_head", c.n_kv_head, f"{why} one K/V head per query head (n_head={c.n_head})")
        return "gpt2"
    why = "RoPE exports as Llama, which needs"
    if c.norm != "rmsnorm":
        _refuse("model.norm", c.norm, f"{why} norm=rmsnorm")
    if c.mlp != "swiglu":
        _refuse("model.mlp", c.mlp, f"{why} mlp=swiglu")
    return "llama"


def _layout(c: GPTConfig, arch: str) -> list[tuple[str, list[str], bool, list[int] | None]]:
    """(our name, its Hugging Face name(s), transposed, split sizes): several HF names (and the
    sizes to split ours into) where we fuse what HF keeps apart."""
    entries = []
    if arch == "gpt2":
        entries += [("tok_emb.weight", ["transformer.wte.weight"], False, None),
                    ("pos_emb.weight", ["transformer.wpe.weight"], False, None)]
        pairs = (("norm_attn", "ln_1", False), ("attn.qkv", "attn.c_attn", True), ("attn.proj", "attn.c_proj", True),
                 ("norm_mlp", "ln_2", False), ("mlp.up", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True))
        for i in range(c.n_layer):
            for ours, theirs, transposed in pairs:
                for suffix in ("weight", "bias"):
                    entries.append((f"blocks.{i}.{ours}.{suffix}", [f"transformer.h.{i}.{theirs}.{suffix}"],
                                    transposed and suffix == "weight", None))
        entries += [(f"norm_out.{s}", [f"transformer.ln_f.{s}"], False, None) for s in ("weight", "bias")]
    else:
        qkv_sizes = [c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.n_kv_head * c.head_dim]
        entries.append(("tok_emb.weight", ["model.embed_tokens.weight"], False, None))
        for i in range(c.n_layer):
            o, h = f"blocks.{i}.", f"model.layers.{i}."
            entries += [(o + "norm_attn.weight", [h + "input_layernorm.weight"], False, None),
                        (o + "norm_mlp.weight", [h + "post_attention_layernorm.weight"], False, None)]
            for s in ("weight", "bias"):
                entries += [
                    (f"{o}attn.qkv.{s}", [f"{h}self_attn.{p}_proj.{s}" for p in "qkv"], False, qkv_sizes),
                    (f"{o}attn.proj.{s}", [f"{h}self_attn.o_proj.{s}"], False, None),
                    (f"{o}mlp.up.{s}", [f"{h}mlp.gate_proj.{s}", f"{h}mlp.up_proj.{s}"], False, [c.d_ff, c.d_ff]),
                    (f"{o}mlp.proj.{s}", [f"{h}mlp.down_proj.{s}"], False, None),
                ]
        entries.append(("norm_out.weight", ["model.norm.weight"], False, None))
    if not c.tie_embeddings:
        entries.append(("lm_head.weight", ["lm_head.weight"], False, None))
    return entries


def hf_config(c: GPTConfig, arch: str, eot_id: int, dtype: torch.dtype) -> dict:
    """config.json for `transformers`: what its from_pretrained needs to rebuild the same model."""
    common = {"vocab_size": c.vocab_size, "tie_word_embeddings": c.tie_embeddings, "bos_token_id": eot_id,
              "eos_token_id": eot_id, "initializer_range": c.init_std, "use_cache": True,
              "dtype": str(dtype).removeprefix("torch.")}
    if arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_positions": c.max_seq_len, "n_embd": c.d_model, "n_layer": c.n_layer, "n_head": c.n_head,
                "n_inner": c.d_ff, "activation_function": "gelu_new", "layer_norm_epsilon": c.norm_eps,
                "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.attention_dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head, "head_dim": c.head_dim,
            "hidden_act": "silu", "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
            "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "attention_bias": c.bias, "mlp_bias": c.bias, "attention_dropout": c.attention_dropout}


def to_hf_state_dict(model, arch: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    ours = model.state_dict()
    out = {}
    for name, hf_names, transposed, sizes in _layout(model.config, arch):
        if name not in ours:     # a bias the model does not have
            if arch == "gpt2":   # GPT-2 always has biases: zeros compute the same function
                ours[name] = torch.zeros(ours[name.replace(".bias", ".weight")].shape[0])
            else:
                continue
        tensor = ours[name].t() if transposed else ours[name]
        parts = tensor.split(sizes) if sizes else [tensor]
        out.update({n: p.detach().to("cpu", dtype).contiguous() for n, p in zip(hf_names, parts)})
    return out


def tokenizer_json_text(tokenizer) -> str:
    """The tokenizer as a `tokenizers` tokenizer.json. The bytes tokenizer becomes a byte-level
    BPE with no merges whose 256 symbols have ids 0..255, plus <|endoftext|> at 256: the same ids."""
    if isinstance(tokenizer, ByteTokenizer):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOT_TOKEN, special=True)])
        return tok.to_str()
    path = getattr(tokenizer, "path", None)
    if path is None:
        raise ValueError(f"tokenizer {tokenizer.name!r} has no tokenizer.json to export")
    return Path(path).read_text()


def _byte_symbols() -> list[str]:
    """The printable character byte-level BPE uses for each byte value (GPT-2's mapping): bytes
    that are printable Latin-1 stand for themselves, the rest take characters from 256 upwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


EXPORT_FILES = (WEIGHTS_FILE, TOKENIZER_FILE, "tokenizer_config.json", "config.json")


def check_export_folder(out_dir: str | Path) -> None:
    """Refuse a folder that holds a file an export writes: nothing is replaced, since a run's own
    model.safetensors or an earlier export would be lost (and a failed export removes what it wrote)."""
    taken = [name for name in EXPORT_FILES if (Path(out_dir) / name).exists()]
    if taken:
        raise ValueError(f"{out_dir} already holds {', '.join(taken)}: export to a folder without them")


def export_hf(model, tokenizer, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write config.json, model.safetensors and the tokenizer files `from_pretrained` reads."""
    from tokenizers import Tokenizer

    from training.interop.weights import save_safetensors
    from training.run.files import write_text

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; valid: {', '.join(DTYPES)}")
    arch = hf_architecture(model.config)   # refuse before writing anything
    if getattr(model, "window", None) is not None:
        _refuse("attention.window", model.window, "gpt2 and llama attend to every earlier token")
    out = Path(out_dir)
    tokenizer_text = tokenizer_json_text(tokenizer)
    eot = Tokenizer.from_str(tokenizer_text).id_to_token(tokenizer.eot_id)
    texts = {TOKENIZER_FILE: tokenizer_text,
             "tokenizer_config.json": json.dumps({
                 "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eot, "eos_token": eot,
                 "model_max_length": model.config.max_seq_len, "clean_up_tokenization_spaces": False}, indent=2) + "\n",
             "config.json": json.dumps(hf_config(model.config, arch, tokenizer.eot_id, DTYPES[dtype]), indent=2) + "\n"}
    check_export_folder(out)
    # Each file atomically, config.json (what marks a folder as an export) last; a failure (a full
    # disk) removes what this export wrote, so no partial export is left behind.
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        written.append(save_safetensors(to_hf_state_dict(model, arch, DTYPES[dtype]), out / WEIGHTS_FILE,
                                        {"format": "pt"}))
        for name, text in texts.items():
            written.append(write_text(out / name, text))
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    return out


def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        raise ValueError(f"model.init_from={folder}: no config.json there (a folder written by save_pretrained)")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model.init_from={folder}: {path} is not readable JSON ({e})") from None


def model_options_from_hf(hf: dict, folder) -> dict:
    """Our model keys for the architecture in config.json; ValueError naming what does not map."""
    kind = hf.get("model_type")

    def refuse(key, why):
        raise ValueError(f"model.init_from={folder}: {key}={hf.get(key)!r} does not map: {why}")

    if kind == "gpt2":
        if hf.get("activation_function", "gelu_new") not in GPT2_GELU:
            refuse("activation_function", f"flashtrain's GELU is the tanh approximation ({', '.join(GPT2_GELU)})")
        if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
            refuse("scale_attn_by_inverse_layer_idx", "flashtrain scales scores by 1/sqrt(head_dim) only")
        return {"n_layer": hf["n_layer"], "n_head": hf["n_head"], "n_kv_head": hf["n_head"],
                "d_model": hf["n_embd"], "d_ff": hf.get("n_inner") or 4 * hf["n_embd"],
                "vocab_size": hf["vocab_size"], "max_seq_len": hf["n_positions"], "pos_emb": "learned",
                "norm": "layernorm", "norm_eps": hf.get("layer_norm_epsilon", 1e-5), "mlp": "gelu", "bias": True,
                "tie_embeddings": hf.get("tie_word_embeddings", True)}
    if kind == "llama":
        if hf.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "SwiGLU uses silu")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
            refuse("head_dim", "flashtrain's head dim is hidden_size / num_attention_heads")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            refuse("rope_parameters" if "rope_parameters" in hf else "rope_scaling", "only plain RoPE (rope_type default)")
        if bool(hf.get("attention_bias")) != bool(hf.get("mlp_bias")):
            refuse("mlp_bias", f"flashtrain has one bias switch; attention_bias={hf.get('attention_bias')!r} differs")
        return {"n_layer": hf["num_hidden_layers"], "n_head": hf["num_attention_heads"],
                "n_kv_head": hf.get("num_key_value_heads") or hf["num_attention_heads"],
                "d_model": hf["hidden_size"], "d_ff": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
                "pos_emb": "rope", "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                "norm": "rmsnorm", "norm_eps": hf.get("rms_norm_eps", 1e-6), "mlp": "swiglu",
                "bias": bool(hf.get("attention_bias")), "tie_embeddings": hf.get("tie_word_embeddings", False)}
    raise ValueError(f"model.init_from={folder}: model_type={kind!r} does not map (gpt2 and llama do)")


def tokenizer_options_from_hf(hf: dict, folder) -> dict:
    """tokenizer=pretrained on the folder's tokenizer.json, its end-of-sequence token as our EOT."""
    from tokenizers import Tokenizer

    path = Path(folder).expanduser() / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(f"model.init_from={folder}: no {TOKENIZER_FILE} there (save the tokenizer with "
                         f"save_pretrained into the same folder)")
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    token = Tokenizer.from_file(str(path)).id_to_token(eos) if eos is not None else None
    if token is None:
        settings = Path(folder).expanduser() / "tokenizer_config.json"
        token = json.loads(settings.read_text()).get("eos_token") if settings.is_file() else None
        token = token.get("content") if isinstance(token, dict) else token
    if token is None:
        raise ValueError(f"model.init_from={folder}: neither config.json nor tokenizer_config.json names an "
                         f"end-of-sequence token")
    return {"name": "pretrained", "path": str(path), "eot_token": token}


def apply_init_from(cfg: DictConfig) -> None:
    """Make cfg's model and tokenizer those of the folder in cfg.model.init_from (in place, so the
    run's config.yaml records them). A Llama's max_seq_len stays the run's: RoPE has no table,
    so training can extend the context; GPT-2's is its position table's size."""
    from training.run.report import hydra_overrides

    folder = cfg.model.init_from
    hf = read_hf_config(folder)
    options = model_options_from_hf(hf, folder)
    given = {o.lstrip("+~").split("=", 1)[0].removeprefix("model.") for o in hydra_overrides() or ()
             if o.lstrip("+~").startswith("model.")}
    conflicts = [k for k in options if k in given and cfg.model[k] != options[k]]
    if conflicts:   # the folder's architecture wins; a value the user typed must not vanish silently
        raise ValueError(f"model.init_from={folder}: its config.json sets model.{conflicts[0]}={options[conflicts[0]]!r}, "
                         f"the command line model.{conflicts[0]}={cfg.model[conflicts[0]]!r}: drop that override")
    _weight_files(Path(folder).expanduser())   # a missing or torn weights file is refused before any work
    with open_dict(cfg):
        for key, value in options.items():
            cfg.model[key] = value
        cfg.tokenizer = tokenizer_options_from_hf(hf, folder)


def _weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files, each header read (which also checks the file is as long as it
    says); ValueError naming the file that is missing or torn."""
    from safetensors import safe_open

    if (folder / WEIGHTS_FILE).is_file():
        files = [folder / WEIGHTS_FILE]
    elif (folder / WEIGHTS_INDEX).is_file():
        try:
            shards = json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"].values()
        except (OSError, UnicodeDecodeError, ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"model.init_from={folder}: {WEIGHTS_INDEX} is not a weights index ({e!r})") from None
        files = [folder / shard for shard in sorted(set(shards))]
    else:
        raise ValueError(f"model.init_from={folder}: no {WEIGHTS_FILE} (save with safe_serialization, the default)")
    for path in files:
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 (missing, torn or foreign: one line naming the file)
            raise ValueError(f"model.init_from={folder}: {path.name} is unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return files


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for path in _weight_files(folder) for k, v in load_file(path).items()}


def load_hf_weights(model, folder: str | Path) -> None:
    """Copy the folder's weights into `model` (built from model_options_from_hf), checking every name."""
    folder = Path(folder).expanduser()
    arch = hf_architecture(model.config)
    hf = _read_weights(folder)
    if arch == "gpt2":   # GPT-2 files from the original release name keys without "transformer."
        hf = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in hf.items()}
    wanted = model.state_dict()
    state, used = {}, set()
    for name, hf_names, transposed, _ in _layout(model.config, arch):
        if name not in wanted:
            continue
        missing = [n for n in hf_names if n not in hf]
        if missing:
            raise ValueError(f"model.init_from={folder}: the weights lack {missing[0]}")
        tensor = torch.cat([hf[n] for n in hf_names]) if len(hf_names) > 1 else hf[hf_names[0]]
        state[name] = tensor.t() if transposed else tensor
        used.update(hf_names)
    if model.config.tie_embeddings:
        used.add("lm_head.weight")   # some files store the tied head too
    extra = [k for k in hf if k not in used and not k.endswith(IGNORED_SUFFIXES)]
    if extra:
        raise ValueError(f"model.init_from={folder}: weight {extra[0]} has no place in the model")
    for name, tensor in state.items():
        if tensor.shape != wanted[name].shape:
            raise ValueError(f"model.init_from={folder}: {name} has shape {tuple(tensor.shape)}, "
                             f"the model wants {tuple(wanted[name].shape)}")
    missing, _ = model.load_state_dict({k: v.to(wanted[k].dtype) for k, v in state.items()}, strict=False)
    unfilled = sorted(set(missing) - ({"lm_head.weight"} if model.config.tie_embeddings else set()))
    if unfilled:
        raise ValueError(f"model.init_from={folder}: nothing to load into {unfilled[0]}")

