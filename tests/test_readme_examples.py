"""Every command in the README and docs/, copied from them and tried as written on a CPU, in a
folder where `runs/a` is a tiny finished run, a sweep sits under multirun/ and the files the
examples name exist: train.py's commands compose and pass the config's checks (running them is
minutes to days of training, some on GPUs), the tools run to exit status 0, and the GPU-only ones
refuse in one line. The tools run in this process (as `python scripts/<tool>.py` does, through
run_cli), which keeps the whole tour to about a minute, most of it max_context's CPU comparison
(run with SHRUNK's overrides appended: the command as written is composed and checked first)."""
from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.trainrun import REPO, cache_dir, run_in_process, tiny_overrides  # noqa: F401 (cache_dir is a fixture)

sys.path.insert(0, str(REPO / "scripts"))
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GPU_TOOLS = {"bench_attention", "bench_attention_scores", "bench_document_mask", "bench_generation", "bench_parallel",
             "bench_ring_attention", "check_gpu_resume", "profile_step"}   # without --smoke (where they have it) they refuse on a CPU
# The documented tool commands not run here, with the reason: minutes on a CPU (each tool's own
# test runs it at a smaller size), or a write into the committed benchmarks/.
NOT_RUN = {
    ("max_context", "model=gpt2-small"): "a gpt2-small model for each search, then nothing fits the CPU's budget "
                                         "(test_max_context.py checks what it says then)",
    ("eval_passkey", "16384"): "about 70 s of 16K-token prompts on a CPU (test_data_scripts.py runs it smaller)",
    ("eval_passkey", "runs/probe"): "evaluates the passkey probe of docs/long-context.md, whose training is about "
                                    "6 minutes on a CPU (test_data_scripts.py runs the tool on a small run)",
    ("eval_passkey", "runs/dense"): "evaluates the dense curriculum of docs/long-context.md, whose three stages "
                                    "train for about 15 minutes on a CPU (test_data_scripts.py runs the tool on a small run)",
    ("eval_passkey_documents", "runs/retrieval"): "reads the README recipe's run, about 11 minutes of an H100 "
                                                   "(test_long_context_passkey.py runs the tool on the mixed CPU variant)",
    ("eval_loss_by_position", "--beside"): "needs runs/a's own result under outputs/eval/ first "
                                           "(test_long_context_passkey.py runs both)",
    ("bench_ring_balance", ""): "about a minute of counting (test_bench_ring_balance.py runs it smaller)",
    ("compare_attention_losses", ""): "300 steps of flash in Triton's interpreter (test_compare_attention_losses.py)",
    ("plot_max_context", "--out benchmarks/"): "rewrites a committed figure under benchmarks/",
    ("export_weights", ".dcp"): "needs an FSDP run's sharded checkpoint (test_scaleout.py exports one)",
    ("bench_generation", "--smoke"): "test_bench_generation.py runs it (here, with the tests' Triton interpreter on, "
                                     "it would decode with flash too: 30 s)",
}
# Documented tool commands run here with key=value overrides appended that keep what the command
# shows but shrink its work, with the reason. The command as written still parses, composes and
# passes its checks (the CPU's defaults filled in) before the shrunk one runs.
SHRUNK = {
    "python scripts/max_context.py": (
        ["memory_budget_mb=20", "start=192", "granularity=64", "cap=256"],
        "flash's steps run in Triton's interpreter, 3 to 30 s each: the CPU's default search (64 tokens "
        "doubled, bisected to 64) steps flash at six lengths, over 100 s. Under a 20 MiB budget (the "
        "state's ~10 MiB and ~10 for a step, not 16) from 192 by 64 to a cap of 256 it is two steps, one "
        "that fits (14 s) and one that runs out of the budget; naive runs out at 192 and fits at 128 "
        "(31 s in all on 2 cores, against 60 s for 256 and 384 under the default budget)"),
}


TOOL_PATH = r"scripts/(?:\w+/)?(\w+)\.py"   # a user tool, or one in scripts/bench/ or scripts/kernel_dev/


@dataclass(frozen=True)
class Command:
    source: str          # the document it is in
    text: str            # as written, continuation lines joined, comment dropped

    @property
    def argv(self) -> list[str]:
        # bash's $'...' (ANSI-C quoting: $'\n\n' is two newlines), which shlex does not know
        text = re.sub(r"\$'((?:[^'\\]|\\.)*)'", lambda m: shlex.quote(m.group(1).encode().decode("unicode_escape")),
                      self.text)
        return shlex.split(text)

    @property
    def tool(self) -> str | None:
        """'train' for train.py (alone or under a launcher), a scripts/ tool's name, or None."""
        for word in self.argv:
            if word == "train.py":
                return "train"
            found = re.fullmatch(TOOL_PATH, word)
            if found:
                return found.group(1)
        return None

    @property
    def args(self) -> list[str]:
        argv = self.argv
        at = next(i for i, w in enumerate(argv) if w == "train.py" or re.fullmatch(TOOL_PATH, w))
        return argv[at + 1:]


def documented_commands() -> list[Command]:
    """train.py and scripts/ commands in code blocks (bash or plain) and inline code spans, each once;
    those with a placeholder (`...`, `<checkout>`, a shell variable, SWEEP_DIR) are not commands."""
    found: dict[tuple, Command] = {}
    for path in DOCUMENTS:
        text = path.read_text()
        spans = []
        for block in re.finditer(r"```(\w*)\n(.*?)```", text, re.S):
            if block.group(1) in ("", "bash", "sh"):
                spans += block.group(2).replace("\\\n", " ").splitlines()
        spans += [m.group(1) for m in re.finditer(r"(?<!`)`((?:python3?|torchrun) [^`]+)`", text)]
        for span in spans:
            line = " ".join(span.split())
            if not re.match(r"(python3?|torchrun) ", line):
                continue
            line = re.sub(r"\s+#.*$", "", line)   # a trailing comment
            if re.search(r"\.\.\.|<\w|\$\w|SWEEP_DIR", line):
                continue
            command = Command(path.name, line)
            if command.tool is not None:
                found.setdefault((command.tool, tuple(command.argv)), command)
    return list(found.values())


COMMANDS = documented_commands()


def test_the_docs_hold_the_commands_this_test_tries():
    tools = {c.tool for c in COMMANDS}
    assert {"train", "generate", "export_weights", "export_hf", "compare_runs", "max_context", "data_stats"} <= tools
    assert len([c for c in COMMANDS if c.tool == "train"]) >= 20
    assert any(c.text == "python scripts/max_context.py" for c in COMMANDS)   # the CPU's comparison


def test_every_documented_tool_is_where_the_command_says():
    """A tool moved to another folder of scripts/ leaves no command naming its old place."""
    for command in COMMANDS:
        named = next(w for w in command.argv if w == "train.py" or re.fullmatch(TOOL_PATH, w))
        assert (REPO / named).is_file(), f"{command.source}: {command.text}"


def train_overrides(command: Command) -> list[str]:
    """What train.py composes for a command: its overrides, a sweep's (-m) first value of each."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args, overrides = command.args, []
    skip = False
    for word in args:
        if skip or word in ("-m", "--multirun", "--help"):
            skip = False
            continue
        if word == "--cfg":   # --cfg job|hydra|all
            skip = True
            continue
        overrides.append(word)
    if "-m" in args or "--multirun" in args:
        parsed = OverridesParser.create().parse_overrides(overrides)
        overrides = [o.input_line if not o.is_sweep_override() else
                     f"{o.get_key_element()}={next(o.sweep_string_iterator())}" for o in parsed]
    return overrides


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.tool == "train"], ids=lambda c: f"{c.source}: {c.text}")
def test_every_documented_train_command_composes_and_passes_the_checks(command):
    """A typo in a command, a preset that does not exist, an override Hydra cannot parse (the docs'
    data.paths=[~/corpus]) or a value the schema refuses fails here, as it would for a reader."""
    from training.config import compose, repeated_override
    from training.config.checks import validate_config

    overrides = train_overrides(command)
    assert repeated_override(overrides) is None
    validate_config(compose(overrides))


# --------------------------------------------------------------------------- the tools, run as written

@pytest.fixture(scope="module")
def workdir(tmp_path_factory, cache_dir):  # noqa: F811
    """A folder holding what the examples name: runs a, b and shakespeare-char (one tiny finished run),
    a checkpoint of step 300, a sweep, outputs/latest, prompt files and a small corpus."""
    root = tmp_path_factory.mktemp("docs")
    run = root / "runs" / "a"
    assert run_in_process(tiny_overrides(run, cache_dir, steps=4, **{"trainer.eval_every": 2})) == 0
    shutil.copy(run / "checkpoints" / "step_00000004.pt", run / "checkpoints" / "step_00000300.pt")
    for copy in ("runs/b", "runs/shakespeare-char", "multirun/2026-12-01/10-00-00/0", "multirun/2026-12-01/10-00-00/1"):
        shutil.copytree(run, root / copy, ignore=shutil.ignore_patterns(".lock"))
    (root / "outputs").mkdir()
    (root / "outputs" / "latest").symlink_to(run)
    (root / "p1.txt").write_text("def ")
    (root / "p2.txt").write_text("class ")
    (root / "my" / "dir").mkdir(parents=True)
    for module in (shlex, shutil, contextlib):   # a few hundred KB of text
        (root / "my" / "dir" / f"{module.__name__}.txt").write_text(Path(module.__file__).read_text())
    return root


def run_tool(command: Command, workdir: Path, monkeypatch) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python scripts/<tool>.py args` run in `workdir`."""
    from _common import run_cli

    module = importlib.import_module(command.tool)
    monkeypatch.chdir(workdir)
    if command.argv[0] == "torchrun":   # what torchrun tells its one worker of this process
        for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", [module.__file__, *command.args])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_cli(module.main)
            status = 0
        except SystemExit as e:
            status = e.code
    return status, out.getvalue(), err.getvalue()


def not_run(command: Command) -> str | None:
    return next((why for (tool, mark), why in NOT_RUN.items() if tool == command.tool and mark in command.text), None)


TOOLS = [c for c in COMMANDS if c.tool not in ("train", None)]
RUN_HERE = [c for c in TOOLS if not_run(c) is None]


def test_the_tool_commands_not_run_here_are_the_known_slow_ones():
    """Each command left out is one NOT_RUN names (a new documented command runs here unless it is
    added there with its reason); each NOT_RUN entry still matches a command; those of
    max_context.py get as far as its arguments and config go before any work."""
    left_out = [c for c in TOOLS if not_run(c) is not None]
    assert {(t, m) for t, m in NOT_RUN for c in left_out if c.tool == t and m in c.text} == set(NOT_RUN)
    assert set(SHRUNK) <= {c.text for c in RUN_HERE}   # each shrunk command is still documented, and run
    for command in (c for c in left_out if c.tool == "max_context"):
        validated_max_context_config(command)


@pytest.mark.slow
@pytest.mark.parametrize("command", RUN_HERE, ids=lambda c: f"{c.source}: {c.text}")
def test_every_documented_tool_command_works_on_the_first_try(command, workdir, cache_dir, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FLASHTRAIN_CACHE", str(cache_dir))   # the default corpus's token cache: not the user's
    gpu_only = command.tool in GPU_TOOLS and "--smoke" not in command.args
    if gpu_only and torch.cuda.is_available():
        pytest.skip("a GPU benchmark: minutes of device time")
    documented = command.text
    if documented in SHRUNK:   # as written: its arguments and config pass, with the device's defaults
        check_the_command_as_written(command)
        command = Command(command.source, " ".join([documented, *SHRUNK[documented][0]]))
    status, out, err = run_tool(command, workdir, monkeypatch)
    if gpu_only:   # on a CPU: one line, before any work
        assert status == 2 and len(err.strip().splitlines()) == 1, err
        assert re.search(r"CUDA|GPU", err), err
        return
    assert status == 0, f"{command.text}\n{err}"
    assert "\r" not in err and "Traceback" not in err
    if documented == "python scripts/max_context.py":
        check_the_cpu_comparison(out)


def validated_max_context_config(command: Command):
    """What a max_context.py command does before any work: its options and config compose and pass
    validate() on the CPU (which fills in the CPU's search defaults); the config."""
    import max_context

    args = max_context.parse_args(command.args)
    cfg = max_context.compose_config(args.overrides, args.attention)
    max_context.validate(cfg, torch.device("cpu"))
    return cfg


def check_the_command_as_written(command: Command) -> None:
    """What a shrunk command does before any work, as written: for max_context, the CPU's search."""
    import max_context

    assert command.tool == "max_context", "only max_context's check is written here"
    cfg = validated_max_context_config(command)
    assert (cfg.start, cfg.granularity, cfg.cap) == tuple(max_context.CPU_SEARCH.values())


def check_the_cpu_comparison(out: str) -> None:
    """`python scripts/max_context.py` on a CPU: naive, sdpa and flash (interpreted) all measured, each
    search ending at a step that ran out of the budget, and they differ."""
    import json

    stem = re.search(r"wrote (\S+)\.json", out).group(1)
    report = json.loads(Path(f"{stem}.json").read_text())
    found = {r["impl"]: r for r in report["results"]}
    assert list(found) == ["naive", "sdpa", "flash"] and all(r["error"] is None for r in found.values())
    assert 0 < found["naive"]["max_length"] < found["sdpa"]["max_length"] <= found["flash"]["max_length"]
    for r in found.values():   # the out-of-memory a probe runs into is caught, interpreted flash's too
        assert not r["capped"] and any(not p["fits"] and "out of memory" in p["error"] for p in r["probes"])
    step = {impl: max((p for p in r["probes"] if p["fits"]), key=lambda p: p["length"])["step_s"]
            for impl, r in found.items()}
    assert step["flash"] > 10 * step["sdpa"]   # the interpreter
    table = out[out.index("Longest training step"):]
    rows = [line for line in table.splitlines() if line.startswith("│") and re.search(r"\b(naive|sdpa|flash)\b", line)]
    assert len(rows) == 3 and len({re.sub(r"\b(naive|sdpa|flash)\b", "", row) for row in rows}) == 3, rows
