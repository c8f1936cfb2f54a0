"""What the user tools in scripts/ share: the repo on sys.path, run metadata and result writers.

Scripts run as `python scripts/<tool>.py`, which puts scripts/ (not the repo root) first on
sys.path; importing this module first makes `model`, `kernels`, `training` importable from any
working directory. The benchmarks (scripts/bench/) and kernel-development tools
(scripts/kernel_dev/) put scripts/ on sys.path themselves, first, so the same import works there. Every result file records where it came from (date, device, versions, commit),
is written atomically (a crash mid-write never leaves half a JSON), and is rewritten as results
arrive, so a run killed half-way still leaves what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from contextlib import contextmanager, suppress
from typing import Any, Callable, Iterator, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

COMMIT_ENV = "FLASHTRAIN_COMMIT"  # names the commit where the checkout has no .git (e.g. a copied tree)


def git_commit() -> str | None:
    """$FLASHTRAIN_COMMIT when set (a copy of the tree, e.g. on a GPU machine, may carry a stale
    .git), else HEAD of the repo with '-dirty' when tracked files differ."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def device_slug(device: torch.device) -> str:
    """Short lowercase tag for file names: 'NVIDIA H200' -> 'h200', any CPU -> 'cpu'."""
    return name_slug(device_name(device)) if device.type == "cuda" else "cpu"


def name_slug(gpu_name: str) -> str:
    """device_slug of a GPU by its name (a result file's `device`, read on another machine)."""
    words = [w for w in re.split(r"[^a-z0-9]+", gpu_name.lower()) if w and w != "nvidia"]
    return "-".join(words) or "cuda"


def environment(device: torch.device) -> dict[str, Any]:
    """Metadata stored beside every result, so a number can be traced to its setting."""
    import triton

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "device_type": device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_commit": git_commit(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                    device_memory_bytes=props.total_memory,
                    alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                    flashtrain_autotune=os.environ.get("FLASHTRAIN_AUTOTUNE", "1"))
    return meta


def run_cli(main: Callable[[list[str]], Any]) -> None:
    """Call a script's main with its arguments. Bad input (a ValueError, a missing file, a bad
    config key, value or type) becomes one line on stderr and exit status 2, as train.py does;
    FLASHTRAIN_TRACEBACK=1 shows the whole traceback instead."""
    try:
        main(sys.argv[1:])
    except Exception as exc:  # noqa: BLE001 (only bad input and the machine's faults are caught; a bug re-raised)
        from training.process.faults import os_error_line
        try:   # only now: the kernel tools run without Hydra, where no config error can arise
            from training.config.errors import config_error_line, is_config_error
        except ImportError:
            config_error_line, is_config_error = None, lambda exc: False

        if not isinstance(exc, (ValueError, OSError)) and not is_config_error(exc) \
                or os.environ.get("FLASHTRAIN_TRACEBACK") == "1":
            raise
        if is_config_error(exc):
            line = config_error_line(exc)
        elif isinstance(exc, OSError):   # a full disk, a read-only folder: what and where, and what to do
            line = os_error_line(exc)
        else:
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


# One CLI for every tool: argparse options, the same names for the same idea, and train.py's own
# `key=value` overrides as positional arguments wherever a tool builds from the training config.
OUTPUTS_ENV = "FLASHTRAIN_OUTPUTS"   # another folder for the tools' default results (the tests use a temporary one)
OUTPUTS = Path(os.environ.get(OUTPUTS_ENV) or REPO_ROOT / "outputs")   # git-ignored; benchmarks/ holds committed results


class ArgumentParser(argparse.ArgumentParser):
    """argparse with train.py's error style: a bad or missing argument raises ValueError, which
    run_cli prints as one `error: ...` line (exit status 2); the usage text is for --help only."""

    def error(self, message: str):
        raise ValueError(f"{message} (--help lists the options)")

    def parse_args(self, *args, **kwargs):
        return self._checked(super().parse_args(*args, **kwargs))

    def parse_intermixed_args(self, *args, **kwargs):
        return self._checked(super().parse_intermixed_args(*args, **kwargs))

    def _checked(self, namespace):
        """train.py's key=value overrides, where a tool takes them: a key given twice is refused
        (Hydra would take the last one silently), as train.py refuses it. Only a tool given
        overrides loads the config package, so the kernel tools parse without Hydra installed."""
        overrides = list(getattr(namespace, "overrides", None) or [])
        if overrides:
            from training.config import repeated_override

            repeated = repeated_override(overrides)
            if repeated:
                raise ValueError(repeated)
        return namespace


def argument_parser(doc: str | None, **kwargs) -> ArgumentParser:
    """Every tool's parser: its whole docstring (the examples) as --help's description."""
    return ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def existing_file(flag: str, stdin: bool = False):
    """An argparse `type` for an input file: a missing one is refused naming the flag
    (`argument --prompt-file: no such file: p.txt`); '-' is stdin where `stdin`."""
    def check(text: str) -> Path:
        path = Path(text)
        if stdin and text == "-":
            return path
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"no such file: {text}")
        return path
    check.__name__ = flag
    return check


def existing_path(text: str) -> Path:
    """An argparse `type` for a checkpoint, weights file or run folder that must exist."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file or folder: {text}")
    return path


def file_stem(text: str) -> str:
    """An argparse `type` for `--name`, the results' file stem inside --out: an empty name or one
    with a folder in it would write beside or outside the --out folder instead."""
    if text.strip() in ("", ".", "..") or any(sep in text for sep in {"/", os.sep, os.altsep} - {None}):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a file name without folders (the files go into --out)")
    return text


def add_out_argument(parser, script: str, dest: str = "out") -> None:
    """`--out DIR`: where the results go. By default outputs/<script>/ (git-ignored; under
    $FLASHTRAIN_OUTPUTS when set), so an ad-hoc run never rewrites the committed results;
    `--out benchmarks/<topic>` writes those, on purpose.
    A folder that is a file, lies under one or cannot be written is refused as the arguments are parsed."""
    parser.add_argument("--out", dest=dest, type=output_folder, default=OUTPUTS / script,
                        help=f"folder for the results (default outputs/{script}/; committed results: --out benchmarks/<topic>)")


def output_folder(text: str) -> Path:
    """An argparse `type` for an output folder (see require_output_dir)."""
    try:
        require_output_dir(Path(text), "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None
    return Path(text)


def attention_list(text: str, flag: str = "--attention") -> list[str]:
    """`--attention a,b,c`: the attention implementation(s) a tool runs, comma-separated."""
    names = [n for n in text.split(",") if n]
    if not names:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: name at least one")
    return names


def runnable_attentions(names: list[str], device: torch.device, notes: list[str]) -> list[str]:
    """The implementations of `names` that can run on `device`, resolved ('auto' becomes one);
    each left out gets a sentence in `notes` (for the console and the results' header) instead
    of an error inside the results. An unknown name, or none left, is a one-line ValueError."""
    from model.attention import ATTENTION, resolve_attention

    kept = []
    for name in names:
        if name != "auto" and name not in ATTENTION:
            raise ValueError(f"--attention: {name!r} is not registered; valid: {', '.join(ATTENTION)}")
        try:
            resolved = resolve_attention(name, device)
        except ValueError as exc:
            notes.append(f"{name} left out: {str(exc).split(';')[0]}.")
            continue
        if resolved not in kept:
            kept.append(resolved)
    if not kept:
        raise ValueError(f"--attention {','.join(names)}: none of them runs on {device.type} ({' '.join(notes)})")
    return kept


def kernel_bench_device(smoke: bool, what: str = "figures") -> torch.device:
    """The device a kernel benchmark runs on: CUDA; on a CPU only for a --smoke plumbing check, with
    our kernels in Triton's interpreter (switched on here, before the kernels import triton) and one
    thread (tiny shapes: OpenMP threads only wait on each other). Refused in one line otherwise."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not smoke:
            raise ValueError(f"no CUDA device: real {what} need a GPU; use --smoke for a CPU plumbing check")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    return device


def tuning_note(meta: dict[str, Any]) -> str:
    """A sentence for a result's header when our kernels ran with autotuning off."""
    if meta.get("flashtrain_autotune") == "0":
        return " Our kernels' tile shapes were pinned (FLASHTRAIN_AUTOTUNE=0), not autotuned."
    return ""


def error_text(exc: BaseException) -> str:
    """One line for a table cell or JSON field: the type and the first line of the message."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


WARMUP_MS, REP_MS = 25, 100   # do_bench's warm-up and measuring time per call site


def kernel_timer(device: torch.device, cpu_calls: int = 3) -> tuple[Callable[[Callable], float], str]:
    """Milliseconds per call, and how they were measured: triton's do_bench median on CUDA. On
    the CPU (smoke runs, plumbing only) one warm-up then the median of `cpu_calls` calls, or a
    single call when `cpu_calls` is 1 (the Triton interpreter takes seconds per call)."""
    if device.type == "cuda":
        import triton.testing

        return (lambda fn: triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"),
                f"triton.testing.do_bench median, warmup {WARMUP_MS} ms, rep {REP_MS} ms")

    def cpu_median(fn) -> float:
        if cpu_calls > 1:
            fn()
        times = []
        for _ in range(cpu_calls):
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)
    how = "one call" if cpu_calls == 1 else f"median of {cpu_calls} after 1 warm-up"
    return cpu_median, f"time.perf_counter, {how} (CPU smoke run, not a benchmark)"


PASSES = ("fwd", "bwd", "fwd+bwd")
HOST_CALLS = 7   # pass_timer's host=True: calls issued to an idle GPU, timed on the host


def pass_timer(device: torch.device, cpu_calls: int = 3) -> tuple[Callable[..., dict[str, float]], str]:
    """Forward, backward and forward+backward milliseconds, all three from the same calls, and how
    they were measured. `timed(forward, backward)` runs `out = forward()` then `backward(out)`,
    stamping the stream before, between and after; each pass is the median of its spans.
    `timed(..., host=True)` adds "host": the host's milliseconds for one forward+backward issued to
    an idle GPU (median of HOST_CALLS; one call on a CPU). The stamps are on the GPU's clock, but a
    call whose host work outlasts its GPU work keeps the GPU waiting between them, so where "host"
    nears "fwd+bwd" the GPU times measure the host.

    Why not time the backward alone, as torch.autograd.grad over a retained graph: that call starts
    on an idle GPU, so all of the backward's host work (the autograd engine handing it to its device
    thread, the launches) is on the clock, where in a training step it overlaps the forward still
    running. On the H200 it read up to 0.45 ms more than the backward added to a forward+backward
    at 1K-4K tokens a sequence.

    On CUDA the loop is do_bench's (one untimed call that compiles and tunes; warm-up and repetitions
    sized from one timed call, at least 3 repetitions so long calls stay cheap; L2 flushed before
    each call) with CUDA events as the stamps. On the CPU (smoke runs, plumbing only) the stamps are
    time.perf_counter: one untimed call, then `cpu_calls` timed ones."""
    cuda = device.type == "cuda"
    if cuda:
        from triton import runtime

        def stamp():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        def span(a, b) -> float:
            return a.elapsed_time(b)
    else:
        stamp = time.perf_counter

        def span(a, b) -> float:
            return (b - a) * 1e3

    def timed(forward: Callable[[], Any], backward: Callable[[Any], Any], host: bool = False) -> dict[str, float]:
        flush = lambda: None  # noqa: E731
        if cuda:
            driver = runtime.driver.active
            cache = driver.get_empty_cache_for_benchmark()
            flush = lambda: driver.clear_cache(cache)  # noqa: E731

        def call():
            flush()
            began = stamp()
            out = forward()
            between = stamp()
            backward(out)
            return began, between, stamp()

        def settle():
            if cuda:
                torch.cuda.synchronize(device)

        call()
        settle()
        warmup, repeats = 0, cpu_calls
        if cuda:
            probe = call()
            settle()
            estimate = max(span(probe[0], probe[2]), 1e-3)
            warmup, repeats = int(WARMUP_MS / estimate), max(3, int(REP_MS / estimate))
        for _ in range(warmup):
            call()
        stamps = [call() for _ in range(repeats)]
        settle()
        times = {"fwd": statistics.median(span(a, b) for a, b, _ in stamps),
                 "bwd": statistics.median(span(b, c) for _, b, c in stamps),
                 "fwd+bwd": statistics.median(span(a, c) for a, _, c in stamps)}
        if host:
            issued = []
            for _ in range(HOST_CALLS if cuda else 1):   # on a CPU (smoke runs) the plumbing only
                began = time.perf_counter()
                backward(forward())
                issued.append((time.perf_counter() - began) * 1e3)
                settle()
            times["host"] = statistics.median(issued)
        return times

    if cuda:
        how = (f"forward+backward calls, CUDA events before, between and after each (do_bench's loop: warm-up "
               f"{WARMUP_MS} ms, {REP_MS} ms of repetitions, at least 3; L2 flushed), median of each span")
    else:
        how = f"time.perf_counter around forward and backward, median of {cpu_calls} calls after 1 (CPU smoke run, not a benchmark)"
    return timed, how


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_text(path: Path, text: str) -> None:
    """Replace `path` atomically (training.run.files: no partial file or stray .tmp, even on a full disk)."""
    from training.run import files as runfiles

    with new_folders(path.parent):
        runfiles.write_text(path, text)


@contextmanager
def new_folders(folder: Path) -> Iterator[None]:
    """Create `folder` (and its missing parents) for a write that follows; if that write fails, the
    folders this made are removed again when they are still empty: a failed tool leaves nothing."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for path in made:   # deepest first
            with suppress(OSError):
                path.rmdir()
        raise


def require_positive(args, *names: str) -> None:
    """Refuse (one-line ValueError) a count argument below 1, before any work or output."""
    for name in names:
        value = getattr(args, name)
        values = value if isinstance(value, list) else [value]
        bad = [v for v in values if v is not None and v < 1]
        if bad:
            raise ValueError(f"--{name.replace('_', '-')} {bad[0]}: must be a positive integer")


def require_output_file(path: Path | None, flag: str) -> None:
    """Refuse an output path that is a folder (or under a file) before anything is computed."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder: pass a file path")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")


def require_output_dir(path: Path, flag: str) -> None:
    """Refuse an output folder that is a file, lies under a file or cannot be written, before
    anything is computed (the folder itself is made when the first result is written)."""
    named = f"{flag} {path}".strip()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{named} is a file, not a folder")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"{named}: {parent} is a file, not a folder")
    existing = path if path.exists() else parent
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{named}: {existing} is not writable")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from rich.table import Table

    table = Table(title=title)
    for header in headers:
        table.add_column(header, justify="left" if header == headers[0] else "right")
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    out = console()
    if not out.is_terminal:   # a log: as wide as the table, never cut or wrapped at the console's width
        from rich.console import Console

        out = Console(width=max(out.width, Console(width=1 << 16).measure(table).maximum))
    out.print(table)


def save_figure(fig, path: Path) -> None:
    """Write a matplotlib figure as PNG, atomically as write_text does, and free it (scripts draw
    many, headless)."""
    import matplotlib.pyplot as plt

    from training.run.files import write_file

    try:
        with new_folders(path.parent):
            write_file(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))
    finally:
        plt.close(fig)


def draw_safely(out, draw, *args) -> None:
    """Run a plotting function after measurements: a failure to draw is printed, never allowed to
    end a GPU run whose results are still being collected (the JSON has them either way)."""
    try:
        draw(*args)
    except Exception as exc:  # noqa: BLE001
        out.print(f"[red]could not draw the plots: {error_text(exc)}[/]")


def new_figure(rows: int = 1, cols: int = 1, **kwargs):
    """A headless (Agg) figure: the GPU machine has no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, squeeze=False, **kwargs)


def human_bytes(n_bytes: float | None) -> str:
    """'81.3 GiB', '8.4 MiB': one unit that keeps both GPU and CPU-sized figures readable."""
    if n_bytes is None:
        return "-"
    for unit in ("B", "KiB", "MiB"):
        if abs(n_bytes) < 1024:
            return f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024
    return f"{n_bytes:.1f} GiB"


def console():
    """A rich console; when output goes to a log (not a terminal), wide enough for the tables."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=200)


def tokens_label(n: int) -> str:
    """128 -> '128', 11264 -> '11K', 1048576 -> '1M', 1299456 -> '1.24M'."""
    if n >= 2**20:
        return f"{n / 2**20:.3g}M"
    return f"{n / 2**10:.3g}K" if n >= 2**10 else str(n)


def tokens_axis(ax, which: str = "x") -> None:
    """Log-2 scale with token-count labels (1K, 2K, ... 1M) on an axes' x or y axis."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    getattr(ax, f"set_{which}scale")("log", base=2)
    axis = getattr(ax, f"{which}axis")
    axis.set_major_locator(LogLocator(base=2))
    axis.set_major_formatter(FuncFormatter(lambda v, _: tokens_label(int(round(v)))))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def plain_log_axis(ax, which: str = "y") -> None:
    """Log-10 scale labelled 1, 2, 5, 10, 20 ... instead of powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def memory_unit(peaks: Sequence[float]) -> tuple[float, str]:
    """GiB for GPU-sized peaks, MiB for the CPU smoke runs: (divisor, label)."""
    return (2**30, "GiB") if max(peaks, default=0) >= 2**30 else (2**20, "MiB")
