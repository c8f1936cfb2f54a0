"""Document masks and sliding windows in the model and the training loop.

The central check: in a packed window with the document mask (and `model.reset_positions`),
every document gets exactly the per-token loss it gets alone, for every attention
implementation (float64 for naive/sdpa on the CPU, float32 for our kernel in the interpreter).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.sampler import windows_to_batch
from kernels.checks import INTERPRET
from training.builders import build_model   # the schema's checks, then model.build_model
from tests.trainrun import cache_dir, losses, run_in_process, tiny_overrides  # noqa: F401 (fixture)
from training.config import compose
from training.loop.evaluate import evaluate_loss

EOT = 63
# A packed window of 30 tokens (+1 for the targets): the tail of a document cut by the window's
# start, a document of one token (its EOT alone), two whole documents, one cut by the window's end.
DOC_LENGTHS = [5, 1, 9, 7, 9]


def packed_window(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    tokens = []
    for i, n in enumerate(DOC_LENGTHS):
        tokens += list(rng.integers(0, EOT, n - 1)) + ([EOT] if i < len(DOC_LENGTHS) - 1 else [rng.integers(0, EOT)])
    return windows_to_batch([np.asarray(tokens + [EOT])], EOT, return_doc_ids=True)


def tiny_model(attention: str, pos_emb: str = "rope", reset_positions: bool = True, window=None,
               checkpointing: str = "none", dtype=torch.float64, seed: int = 0):
    cfg = compose(["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.n_kv_head=2",
                   f"model.pos_emb={pos_emb}", "model.max_seq_len=32", f"model.reset_positions={reset_positions}",
                   f"model.activation_checkpointing={checkpointing}"])
    torch.manual_seed(seed)
    return build_model(cfg.model, EOT + 1, attention, window=window).to(dtype)


def per_token_loss(model, x, y, **kw) -> torch.Tensor:
    logits = model(x, **kw)
    return F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="none").view(y.shape)


def document_spans(doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    ids = doc_ids[0].tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    return list(zip(starts, starts[1:] + [len(ids)]))


CASES = [("naive", "rope", None), ("sdpa", "rope", None), ("naive", "learned", None), ("sdpa", "learned", 4),
         ("naive", "rope", 3)]


@pytest.mark.parametrize("attention,pos_emb,window", CASES, ids=[f"{a}-{p}-w{w}" for a, p, w in CASES])
def test_packed_documents_get_the_loss_they_get_alone_float64(attention, pos_emb, window):
    x, y, doc_ids = packed_window()
    assert [e - s for s, e in document_spans(doc_ids)] == DOC_LENGTHS
    model = tiny_model(attention, pos_emb, window=window)
    packed = per_token_loss(model, x, y, document_ids=doc_ids)
    unmasked = per_token_loss(model, x, y)
    for start, end in document_spans(doc_ids):
        alone = per_token_loss(model, x[:, start:end], y[:, start:end])
        torch.testing.assert_close(packed[:, start:end], alone, rtol=0, atol=1e-12)
    # the mask is what makes them equal: without it, later documents see the earlier ones
    assert (packed - unmasked).abs().max() > 1e-3


@pytest.mark.skipif(not INTERPRET, reason="runs our kernel on CPU tensors, under the Triton interpreter; on a GPU "
                    "tests/test_document_mask.py checks the kernel's masks in bf16")
def test_packed_documents_get_the_loss_they_get_alone_flash_interpreter():
    x, y, doc_ids = packed_window(seed=1)
    model = tiny_model("flash", "rope", dtype=torch.float32)
    packed = per_token_loss(model, x, y, document_ids=doc_ids)
    for start, end in document_spans(doc_ids):
        alone = per_token_loss(model, x[:, start:end], y[:, start:end])
        torch.testing.assert_close(packed[:, start:end], alone, rtol=0, atol=2e-5)


@pytest.mark.skipif(not INTERPRET, reason="runs our kernel on CPU tensors, under the Triton interpreter")
def test_the_layers_share_one_bounds_build(monkeypatch):
    """Both layers' attention get the model's ids tensor itself, so the kernels' bounds buffer is
    built once a forward (kernels/masks.bounds_buffer), and again for the next batch's ids."""
    from kernels import masks
    built = []
    build = masks._build_bounds
    monkeypatch.setattr(masks, "_build_bounds", lambda *a: built.append(1) or build(*a))
    x, y, doc_ids = packed_window(seed=2)
    model = tiny_model("flash", "rope", dtype=torch.float32)
    per_token_loss(model, x, y, document_ids=doc_ids).sum().backward()
    assert len(built) == 1
    per_token_loss(model, x, y, document_ids=doc_ids.clone())
    assert len(built) == 2


def test_reset_positions_is_what_makes_learned_positions_match():
    x, y, doc_ids = packed_window()
    model = tiny_model("naive", "learned", reset_positions=False)
    start, end = document_spans(doc_ids)[2]
    packed = per_token_loss(model, x, y, document_ids=doc_ids)[:, start:end]
    alone = per_token_loss(model, x[:, start:end], y[:, start:end])
    assert (packed - alone).abs().max() > 1e-4


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_activation_checkpointing_with_masks_gives_the_same_loss_and_gradients(checkpointing):
    x, y, doc_ids = packed_window()
    results = []
    for mode in ("none", checkpointing):
        model = tiny_model("naive", window=6, checkpointing=mode)
        loss = model(x, y, document_ids=doc_ids)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_torch_compile_fullgraph_with_masks_matches_eager_cpu():
    x, y, doc_ids = packed_window()
    model = tiny_model("sdpa", window=6, dtype=torch.float32)
    eager = model(x, y, document_ids=doc_ids)
    compiled = torch.compile(model, fullgraph=True)(x, y, document_ids=doc_ids)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_evaluate_loss_uses_the_document_ids_of_a_batch():
    x, y, doc_ids = packed_window()
    model = tiny_model("naive")
    value = evaluate_loss(model, [(x, y, doc_ids)], torch.device("cpu"), "fp32")
    assert value == pytest.approx(model(x, y, document_ids=doc_ids).item(), rel=1e-6)  # summed in float32
    assert value != pytest.approx(evaluate_loss(model, [(x, y)], torch.device("cpu"), "fp32"), rel=1e-3)


def test_generation_refuses_document_ids_and_decodes_with_a_window():
    from model import KVCache
    from model.generation import decode

    model = tiny_model("naive", window=3).eval()
    x, _, doc_ids = packed_window()
    with pytest.raises(ValueError, match="document_ids cannot be used with a KV cache"):
        model(x, document_ids=doc_ids, cache=KVCache(2, 1, 40))
    prompt = x[:, :7]
    cached = [t for _, t in decode(model, prompt, 6, generator=torch.Generator().manual_seed(0))]
    recomputed = [t for _, t in decode(model, prompt, 6, generator=torch.Generator().manual_seed(0), use_cache=False)]
    assert torch.equal(torch.stack(cached), torch.stack(recomputed))


# ----------------------------------------------------------------------------- the training loop

def test_training_with_document_mask_reset_positions_and_window(tmp_path, cache_dir, capsys):  # noqa: F811
    masked = tiny_overrides(tmp_path / "masked", cache_dir, steps=4, **{
        "data.document_mask": "true", "model.reset_positions": "true", "attention.window": 16,
        "trainer.eval_every": 2, "model.activation_checkpointing": "selective"})
    assert run_in_process(masked) == 0
    plain = tiny_overrides(tmp_path / "plain", cache_dir, steps=4, **{"trainer.eval_every": 2})
    assert run_in_process(plain) == 0
    rows_masked, rows_plain = losses(tmp_path / "masked"), losses(tmp_path / "plain")
    assert all(np.isfinite(r[1]) for r in rows_masked) and rows_masked[-1][2] is not None
    assert rows_masked[0][1] != rows_plain[0][1]   # the same batches, seen through the masks

    # a resume keeps what the model computes
    ckpt = tmp_path / "masked" / "checkpoints" / "step_00000004.pt"
    changed = tiny_overrides(tmp_path / "other", cache_dir, steps=6, resume=str(ckpt), **{
        "model.reset_positions": "true", "data.document_mask": "true"})
    assert run_in_process(changed) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "attention.window=16 in checkpoint, None now" in err, err


@pytest.mark.parametrize("override,message", [
    ({"model.reset_positions": "true"}, "model.reset_positions=True: needs data.document_mask=true"),
    ({"attention.window": 0}, "attention.window=0: must be null"),
    ({"data.document_mask": "maybe"}, "data.document_mask='maybe': must be true or false"),
], ids=["reset-without-mask", "window-0", "mask-not-bool"])
def test_bad_mask_settings_are_one_line_before_any_step(tmp_path, cache_dir, capsys, override, message):  # noqa: F811
    assert run_in_process(tiny_overrides(tmp_path / "run", cache_dir, **override)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and message in err, err


def test_hugging_face_export_refuses_a_sliding_window(tmp_path):
    from data.tokenizer import ByteTokenizer
    from training.interop.huggingface import export_hf

    model = build_model({"name": "t", "n_layer": 1, "n_head": 2, "n_kv_head": 2, "d_model": 32,
                         "max_seq_len": 32}, 257, "sdpa",
                        window=8)
    with pytest.raises(ValueError, match="attention.window=8 does not map .* attend to every earlier token"):
        export_hf(model, ByteTokenizer(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_checkpoints_from_before_reset_positions_still_resume():
    from training.run.resume import check_model_config
    from training.run.store import CheckpointError

    older = {"name": "tiny", "d_model": 64}   # written before model.reset_positions existed
    check_model_config("old.pt", older, {**older, "reset_positions": False})
    with pytest.raises(CheckpointError, match="model.reset_positions=False in checkpoint, True now"):
        check_model_config("old.pt", older, {**older, "reset_positions": True})
