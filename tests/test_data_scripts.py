"""The data tools in scripts/: stats, loader benchmark, loss by position, passkey grid."""
import json
import sys

import pytest

from tests.trainrun import REPO, run_in_process, tiny_overrides

sys.path.insert(0, str(REPO / "scripts"))

import bench_loader  # noqa: E402
import data_stats  # noqa: E402
import eval_loss_by_position  # noqa: E402
import eval_passkey  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    run_in_process(tiny_overrides(root / "tiny", root / "cache", steps=2))
    return root / "tiny", root / "cache"


def test_data_stats_counts_the_cache(tmp_path):
    out = tmp_path / "stats.json"
    data_stats.main([f"data.cache_dir={tmp_path}", "data.max_bytes=200000", "--json", str(out)])
    stats = json.loads(out.read_text())
    assert stats["tokens"] == stats["train_tokens"] + stats["val_tokens"]
    assert stats["bytes_per_token"] == 1.0                                 # bytes tokenizer
    assert sum(h["documents"] for h in stats["doc_tokens_histogram"]) == stats["documents"]
    assert stats["doc_tokens_percentiles"]["0"] >= 10_000                  # stdlib documents: >= 10K bytes


def test_bench_loader_writes_tokens_per_s(tmp_path):
    bench_loader.main([f"data.cache_dir={tmp_path}", "data.max_bytes=1000000", "--seq-len", "4096",
                       "--batches", "5", "--out", str(tmp_path / "out")])   # --out is a folder, as for every tool
    result = json.loads((tmp_path / "out" / "loader_cpu.json").read_text())
    assert result["tokens"] == 5 * 4 * 4096 and result["tokens_per_s"] > 0 and "environment" in result


def test_loss_by_position_table_and_plot(trained, tmp_path):
    run_dir, _ = trained
    eval_loss_by_position.main([str(run_dir), "--device", "cpu", "--seq-len", "128", "--batches", "2",
                                "--buckets", "4", "--out", str(tmp_path), "--name", "t"])
    result = json.loads((tmp_path / "loss_by_position_t.json").read_text())
    assert [(b["start"], b["end"]) for b in result["buckets"]] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert all(0 < b["loss"] < 20 for b in result["buckets"])
    assert (tmp_path / "loss_by_position_t.png").stat().st_size > 0 and (tmp_path / "loss_by_position_t.md").exists()


def test_loss_by_position_with_and_without_the_document_mask(trained, tmp_path):
    run_dir, _ = trained
    common = [str(run_dir), "--device", "cpu", "--seq-len", "4096", "--batches", "4", "--buckets", "4",
              "--out", str(tmp_path)]
    eval_loss_by_position.main(common + ["--document-mask"])
    eval_loss_by_position.main(common)   # the run trained without the mask: its default
    masked = json.loads((tmp_path / "loss_by_position_tiny_docmask.json").read_text())
    plain = json.loads((tmp_path / "loss_by_position_tiny.json").read_text())
    assert masked["document_mask"] is True and plain["document_mask"] is False
    # some of these windows cross a document boundary: there the mask changes the context
    assert any(abs(a["loss"] - b["loss"]) > 1e-4 for a, b in zip(masked["buckets"], plain["buckets"]))


def test_passkey_grid_and_heatmap(trained, tmp_path):
    run_dir, _ = trained
    eval_passkey.main([str(run_dir / "checkpoints"/ "step_00000002.pt"), "--device", "cpu", "--lengths", "128", "256",
                       "--depths", "0", "1", "--trials", "2", "--out", str(tmp_path), "--name", "t"])
    result = json.loads((tmp_path / "passkey_t.json").read_text())
    assert len(result["accuracy"]) == 2 and all(len(r) == 2 and all(0 <= a <= 1 for a in r) for r in result["accuracy"])
    assert (tmp_path / "passkey_t.png").stat().st_size > 0


def test_passkey_scoring_matches_greedy_decoding():
    """An oracle that always predicts the next true token scores 1; one off at a key digit scores 0."""
    import torch

    from data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()

    class Oracle(torch.nn.Module):
        def __init__(self, corrupt: bool):
            super().__init__()
            self.corrupt = corrupt

        def forward(self, idx):
            full = self.full[: idx.shape[1] + 1]
            nxt = full[1:].clone()
            if self.corrupt:
                nxt[-2] = (nxt[-2] + 1) % 256          # wrong second-to-last digit
            return torch.nn.functional.one_hot(nxt, 257).float()[None]

    from data.passkey import passkey_prompt

    prompt, answer = passkey_prompt(200, 0.5, "24680", lambda s: len(s))
    for corrupt, expect in ((False, True), (True, False)):
        model = Oracle(corrupt)
        model.full = torch.tensor(tok.encode(prompt + answer))
        assert eval_passkey.passkey_correct(model, tok, 200, 0.5, "24680", torch.device("cpu"), "fp32") is expect
