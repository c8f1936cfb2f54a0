"""The data tools in scripts/: stats, loader benchmark, loss by position, passkey grid."""
import json
import re
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
    # every wrong trial is kept with what it said; a cell's token share is at least its accuracy
    wrong = sum(round((1 - a) * 2) for row in result["accuracy"] for a in row)
    assert len(result["misses"]) == wrong and all(m["kind"] in eval_passkey.MISS_KINDS for m in result["misses"])
    assert all(t >= a for ts, accs in zip(result["answer_tokens_right"], result["accuracy"]) for t, a in zip(ts, accs))
    assert "The wrong answers" in (tmp_path / "passkey_t.md").read_text()
    # the four cells by distance: 128 and 256 tokens back (depth 0) and 0 (depth 1), bands from 64 on
    bands = [(b["from"], b["to"], b["cells"]) for b in result["by_distance"]]
    assert bands == [(0, 64, 2), (64, 128, 0), (128, 256, 2)], bands
    (near, far), by_band = result["accuracy"][::-1], [b["accuracy"] for b in result["by_distance"]]
    assert by_band == [pytest.approx(sum(near) / 2), None, pytest.approx(sum(far) / 2)]
    assert "| cells | 2 | 0 | 2 |" in (tmp_path / "passkey_t.md").read_text()


def test_passkey_precision_is_the_runs_unless_asked(trained, tmp_path, monkeypatch):
    """--precision runs the forwards in it (fp32: is bf16's rounding what decides a wrong answer?);
    without it, in the run's trainer.precision (fp32 for this CPU run). The JSON and the Markdown say which."""
    run_dir, _ = trained
    used, predict = [], eval_passkey.answer_predictions
    monkeypatch.setattr(eval_passkey, "answer_predictions",
                        lambda model, ids, device, precision: (used.append(precision), predict(model, ids, device, precision))[1])
    common = [str(run_dir), "--device", "cpu", "--lengths", "128", "--depths", "0", "--trials", "1", "--out", str(tmp_path)]
    for asked, want in ((None, "fp32"), ("bf16", "bf16")):
        used.clear()
        eval_passkey.main(common + (["--precision", asked] if asked else []) + ["--name", want])
        result = json.loads((tmp_path / f"passkey_{want}.json").read_text())
        assert result["precision"] == want and used == [want]
        assert f" attention in {want}, " in (tmp_path / f"passkey_{want}.md").read_text()


def test_passkey_cells_pooled_by_distance():
    """Cells pool by (1 - depth) x length into bands that double from half the shortest length up to
    the longest, the last band closed; cells that did not fit count in none; an empty band says so."""
    result = {"lengths": [2048, 8192, 32768], "depths": [0.0, 0.5, 0.9, 1.0],
              "accuracy": [[1.0, 0.5, None], [0.8, 0.6, None], [1.0, 1.0, None], [0.9, 0.7, None]]}
    bands = eval_passkey.by_distance(result)
    assert [(b["from"], b["to"]) for b in bands] == [(0, 1024), (1024, 2048), (2048, 4096), (4096, 8192),
                                                     (8192, 16384), (16384, 32768)]
    # distances: 2048, 1024, ~205, 0 for 2K; 8192, 4096, ~819, 0 for 8K
    assert [b["cells"] for b in bands] == [4, 1, 1, 1, 1, 0]
    assert bands[0]["accuracy"] == pytest.approx((1.0 + 0.9 + 1.0 + 0.7) / 4) and bands[-1]["accuracy"] is None
    assert bands[4]["accuracy"] == 0.5 and "| accuracy | 0.90 | 0.80 | 1.00 | 0.60 | 0.50 | - |" in \
        eval_passkey.distance_markdown(result)


def test_wrong_answers_are_told_apart():
    """A garbled copy of the key is told from an answer that is no key at all, and a cell's token
    share counts the answer tokens that were right."""
    from data.tokenizer import ByteTokenizer

    assert eval_passkey.miss_kind("24680", " 24681") == "one digit wrong"
    assert eval_passkey.miss_kind("24680", " 42680") == "several digits wrong"
    assert eval_passkey.miss_kind("24680", " The r") == "not the key's length of digits"
    assert eval_passkey.miss_kind("24680", " 2468") == "not the key's length of digits"
    tok = ByteTokenizer()
    answers = [tok.encode(" 24680"), tok.encode(" 13579")]
    said = [list(answers[0]), tok.encode(" 13570")]
    result = {"depths": [0.5], "lengths": [256], "trials": 2, "accuracy": [[None]],
              "answer_tokens_right": [[None]], "misses": []}
    eval_passkey.record_length(result, 0, [(0, "24680"), (0, "13579")], [([1], a) for a in answers], said, tok)
    assert result["accuracy"] == [[0.5]] and result["answer_tokens_right"] == [[(1 + 5 / 6) / 2]]
    assert result["misses"] == [{"length": 256, "depth": 0.5, "key": "13579", "predicted": " 13570",
                                 "kind": "one digit wrong", "slip": "not in the key"}]
    assert "| 256 | 1 of 2 | 1 | 0 | 0 | 13579 -> '13570' |" in eval_passkey.misses_markdown(result)


def test_one_digit_slips_are_told_by_where_the_wrong_digit_came_from():
    """A slip's wrong digit is the key's digit before the slipped one, the one after, another of its
    digits, or none of them (checked in that order), each beside its chance for a wrong digit drawn at
    random from the other nine; the Markdown pools them over the grid, from keys and answers alone."""
    before, after, elsewhere, outside = eval_passkey.SLIP_SOURCES
    assert eval_passkey.slip_source("68333", " 66333") == (before, [1 / 9, 1 / 9, 0.0, 7 / 9])
    assert eval_passkey.slip_source("92067", " 90067") == (after, [1 / 9, 1 / 9, 2 / 9, 5 / 9])
    assert eval_passkey.slip_source("13579", " 13571") == (elsewhere, [1 / 9, 0.0, 3 / 9, 5 / 9])
    assert eval_passkey.slip_source("13579", " 23579") == (outside, [0.0, 1 / 9, 3 / 9, 5 / 9])
    # the first digit has no digit before it; a digit both before and after counts as before
    assert eval_passkey.slip_source("12121", " 12111")[0] == before
    misses = [{"key": "68333", "predicted": " 66333", "kind": "one digit wrong"},
              {"key": "13579", "predicted": " 23579", "kind": "one digit wrong"},
              {"key": "13579", "predicted": " 97531", "kind": "several digits wrong"}]
    assert eval_passkey.slips_markdown(misses).endswith(
        "The 2 one-digit slips by where the wrong digit came from (in brackets, what as many wrong digits drawn at "
        "random from the other nine would give): the digit before 1 (0.1), the digit after 0 (0.2), another digit "
        "of the key 0 (0.3), not in the key 1 (1.3).")
    assert eval_passkey.slips_markdown(misses[2:]) == ""


def test_the_wrong_answers_in_all_and_the_cells_chance_would_fail():
    """Under the grid: the wrong answers in all with their 95% Wilson interval, and how many cells
    would fall under 0.95 by chance at that rate (a cell of 20 fails at 2 wrong). 20 wrong of 1,100,
    the README recipe's count: 5.1% of cells, 2.8 of 55, where it had 4; cells that did not fit
    count in none."""
    low, high = eval_passkey.wilson_interval(20, 1100)
    assert (round(low, 4), round(high, 4)) == (0.0118, 0.0279)
    assert eval_passkey.wilson_interval(0, 100)[0] == 0 and eval_passkey.wilson_interval(100, 100)[1] == pytest.approx(1)
    p = 20 / 1100
    assert eval_passkey.chance_under_target(p, 20) == pytest.approx(1 - (1 - p) ** 20 - 20 * p * (1 - p) ** 19)
    assert eval_passkey.chance_under_target(0.0, 20) == 0 and eval_passkey.chance_under_target(p, 10) == \
        pytest.approx(1 - (1 - p) ** 10)   # a cell of 10 fails at its first wrong answer
    cells = [0.9] * 4 + [0.95] * 12 + [1.0] * 39                 # 8 + 12 wrong, 4 cells under 0.95
    accuracy = [cells[5 * i:5 * i + 5] + [None] for i in range(11)]   # 11 depths x 5 lengths, a sixth that did not fit
    text = eval_passkey.rate_markdown({"accuracy": accuracy, "trials": 20})
    assert text.strip() == ("In all, 20 wrong of 1,100 (1.8%, 95% interval 1.2%-2.8%). 4 of 55 cells are under 0.95; "
                            "with every prompt wrong at that rate, independently, 2.8 would be (5.1% of cells of 20).")
    assert eval_passkey.rate_markdown({"accuracy": [[None]], "trials": 20}) == ""


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
    from training.loop.evaluate import passkey_ids, score_prompt

    prompt, answer = passkey_prompt(200, 0.5, "24680", lambda s: len(s))
    for corrupt, expect in ((False, True), (True, False)):
        model = Oracle(corrupt)
        model.full = torch.tensor(tok.encode(prompt + answer))
        ids = passkey_ids(tok, 200, 0.5, "24680")
        assert score_prompt(model, ids, torch.device("cpu"), "fp32") is expect


def test_passkey_lengths_that_do_not_fit_are_not_zeros(trained, tmp_path):
    """A length past the CPU budget is a 'does not fit' column with its reason; the others are measured,
    with their forward's peak memory."""
    run_dir, _ = trained
    eval_passkey.main([str(run_dir), "--device", "cpu", "--lengths", "128", "2048", "--depths", "0", "1",
                       "--trials", "1", "--attention", "naive", "--memory-budget-mb", "4", "--out", str(tmp_path),
                       "--name", "t"])
    result = json.loads((tmp_path / "passkey_t.json").read_text())
    assert result["why_not"] == [None, "out of memory under --memory-budget-mb"]
    assert [row[1] for row in result["accuracy"]] == [None, None] and result["peak_memory_bytes"][0] > 0
    md = (tmp_path / "passkey_t.md").read_text()
    assert re.search(r"^\| 0 \| [01]\.00 \| does not fit \|$", md, re.M) and "2,048*" in md


def test_a_length_past_the_position_table_does_not_fit():
    import torch

    from _eval import memory_meter

    meter = memory_meter(__import__("argparse").Namespace(memory_budget_mb=None), None, torch.device("cpu"))
    hits, why, peak = eval_passkey.length_column(None, [([1] * 12, [2, 3])], meter, torch.device("cpu"), "fp32", 10)
    assert (hits, peak) == (None, None) and why == "13 tokens exceed model.max_seq_len=10"


def test_loss_curves_beside_each_other_must_share_their_held_out_tokens(trained, tmp_path, monkeypatch):
    run_dir, _ = trained
    common = [str(run_dir), "--device", "cpu", "--batches", "2", "--out", str(tmp_path)]
    eval_loss_by_position.main(common + ["--name", "a", "--bucket-tokens", "16"])
    figures = []
    save = eval_loss_by_position.save_figure
    monkeypatch.setattr(eval_loss_by_position, "save_figure", lambda fig, path: (figures.append(fig), save(fig, path)))
    eval_loss_by_position.main(common + ["--name", "b", "--seq-len", "32", "--bucket-tokens", "16",
                                         "--beside", str(tmp_path / "loss_by_position_a.json")])
    b = json.loads((tmp_path / "loss_by_position_b.json").read_text())
    assert b["beside"]["name"] == "a" and len(b["beside"]["buckets"]) == 4 and len(b["buckets"]) == 2
    (fig,) = figures   # the legend hides no point: it is outside the axes (inside, it had hidden a curve's end)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert not ax.get_legend().get_window_extent().overlaps(ax.get_window_extent())
    other = json.loads((tmp_path / "loss_by_position_a.json").read_text()) | {"validation": "0" * 16}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="was evaluated on other held-out tokens"):
        eval_loss_by_position.main(common + ["--name", "c", "--beside", str(tmp_path / "other.json")])
    (tmp_path / "grid.json").write_text(json.dumps({"name": "x", "lengths": [128]}))
    with pytest.raises(ValueError, match=r"not a result of eval_loss_by_position.py \(it has no buckets, validation"):
        eval_loss_by_position.main(common + ["--name", "c", "--beside", str(tmp_path / "grid.json")])


def test_a_grid_cut_short_says_not_run_not_does_not_fit():
    result = {"name": "t", "attention": "naive", "model": "tiny", "trials": 2, "trained_seq_len": 256,
              "lengths": [128, 512, 1024], "depths": [0.0], "accuracy": [[1.0, None, None]],
              "why_not": [None, "out of memory under --memory-budget-mb", None], "peak_memory_bytes": [1, None, None],
              "measured": 2}
    assert eval_passkey.grid_table(result)[1] == [("0", "1.00", "does not fit", "not run")]
    assert "stopped after 2 of 3 lengths" in eval_passkey.grid_markdown(result)
