"""The layers import one way: kernels <- model <- training <- scripts/train.py, and data <- training;
inside training, each package imports only those below it (training/__init__.py lists them).

kernels imports nothing of ours; model imports kernels only; data imports neither; training may
import all three, its packages in their order: process and config at the bottom, then parallel,
run, interop, builders.py, and loop on top; scripts/ and train.py sit on top of it all. The
checkpoint store's DCP format (training/run/dcp.py) is private to the store, and the loop names
no parallel mode and no checkpoint format: it asks the parallel plan and the store. Every import
is read with `ast`, those inside functions included (a deferred import is still an arrow: it only
hides the dependency until the function runs), and the modules of one part must not import each
other in a cycle. The checkers are plain functions so the tests below can feed them a planted
tree and watch them fail.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_BELOW_LOOP = {"kernels", "model", "data", "training.config", "training.process", "training.parallel", "training.run",
               "training.interop", "training.builders"}
# What each part of the checkout may import besides itself. A part is a top-level folder, or a
# package (or top module) of training: training.config is training/config/, training.builders
# is training/builders.py. A part of training missing here is refused until it says its imports.
ALLOWED = {
    "kernels": set(),
    "model": {"kernels"},
    "data": set(),
    "training": set(),                        # training/__init__.py: the map, no code
    "training.config": {"kernels", "model", "training.process"},
    "training.process": set(),
    "training.parallel": {"model", "training.process"},
    "training.run": {"data", "training.config", "training.process", "training.parallel"},
    "training.interop": {"data", "model", "training.process", "training.run"},
    "training.builders": _BELOW_LOOP - {"training.builders"},
    "training.loop": _BELOW_LOOP,
    "training.launch": {"training.process"},  # `python -m training.launch`: torchrun's own launcher
    "scripts": {"kernels", "model", "data", "training"},
    "train": {"kernels", "model", "data", "training"},
}
# Modules that only the named modules may import.
PRIVATE = {"training.run.dcp": {"training.run.store"}}   # the store's sharded format, behind its interface


def _part(module: str) -> str:
    names = module.split(".")
    return ".".join(names[:2]) if names[0] == "training" and len(names) > 1 else names[0]


def _allows(part: str, target: str) -> bool:
    return any(target == a or target.startswith(f"{a}.") for a in ALLOWED.get(part, ()))


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.Module, module: str, is_package: bool, modules: set[str]) -> list[tuple[str, int]]:
    """(imported module of ours, line) for every import in the file, those inside functions too;
    relative imports resolved against `module`. `from pkg import mod` is an arrow to pkg.mod (the
    package itself is already being imported), `from pkg import name` an arrow to pkg."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules]
            names = len(submodules) < len(node.names)
            found += [(sub, node.lineno) for sub in submodules] + ([(target, node.lineno)] if names else [])
    return [(target, line) for target, line in found if target in modules]


def _parse_all(root: Path) -> dict[str, tuple[Path, ast.Module]]:
    files = [root / "train.py"] if (root / "train.py").exists() else []
    for top in {p.split(".")[0] for p in ALLOWED}:
        if (root / top).is_dir():
            files += sorted((root / top).rglob("*.py"))
    return {_module_name(root, path): (path, ast.parse(path.read_text(), filename=str(path))) for path in files}


def check_layers(root: Path) -> list[str]:
    """One line per import against the layer order, one per part of training that does not say
    what it may import, and one per cycle among the modules of one part."""
    modules = _parse_all(root)
    problems: list[str] = []
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, tree) in modules.items():
        part = _part(name)
        if part not in ALLOWED:
            problems.append(f"{path.relative_to(root)}: {part} is not a part of tests/test_import_layers.py's "
                            f"ALLOWED (say what it may import)")
            continue
        for target, line in sorted(_imports(tree, name, path.name == "__init__.py", set(modules)), key=lambda t: t[1]):
            target_part = _part(target)
            where = f"{path.relative_to(root)}:{line}"
            if target_part != part and not _allows(part, target):
                problems.append(f"{where}: {part} imports {target} (part {target_part})")
            if target in PRIVATE and name not in PRIVATE[target] and target != name:
                problems.append(f"{where}: {target} is private to {', '.join(sorted(PRIVATE[target]))}")
            if target_part == part and target != name:
                graph[name].add(target)
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle once, found by depth-first search. A package's __init__ importing its own
    modules is not a cycle unless one of them imports the package back."""
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_the_checkout_imports_one_way():
    assert check_layers(ROOT) == []


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_planted_upward_import_fails(tmp_path):
    root = _plant(tmp_path, {
        "kernels/__init__.py": "",
        "model/__init__.py": "from kernels import flash\n",
        "training/__init__.py": "",
        "training/loop/__init__.py": "",
        "training/loop/trainer.py": "import model\n",
        "model/config.py": "def f():\n    from training.loop.trainer import fit  # deferred, still an arrow\n",
    })
    assert check_layers(root) == ["model/config.py:2: model imports training.loop.trainer (part training.loop)"]


def test_data_may_not_import_model_nor_kernels(tmp_path):
    root = _plant(tmp_path, {"data/__init__.py": "", "model/__init__.py": "", "kernels/masks.py": "",
                             "data/build.py": "from ..model import GPT\nimport kernels.masks\n"})
    assert check_layers(root) == ["data/build.py:1: data imports model (part model)",
                                  "data/build.py:2: data imports kernels.masks (part kernels)"]


def test_a_cycle_in_training_fails_even_through_a_deferred_import(tmp_path):
    root = _plant(tmp_path, {
        "training/__init__.py": "",
        "training/loop/__init__.py": "",
        "training/loop/trainer.py": "from training.loop.evaluate import evaluate\n",
        "training/loop/evaluate.py": "def load():\n    from training.loop import trainer\n",
    })
    assert check_layers(root) == ["import cycle: training.loop.evaluate -> training.loop.trainer -> training.loop.evaluate"]
    (root / "training/loop/evaluate.py").write_text("def load():\n    from training.loop import optim\n")
    (root / "training/loop/optim.py").write_text("")
    assert check_layers(root) == []


def test_training_packages_may_only_import_those_below_them(tmp_path):
    root = _plant(tmp_path, {
        "training/__init__.py": "",
        "training/process/__init__.py": "",
        "training/process/faults.py": "def f():\n    from training.run.files import os_error_in  # upward, deferred\n",
        "training/run/__init__.py": "",
        "training/run/files.py": "import training.process.faults\n",
        "training/loop/__init__.py": "",
        "training/loop/trainer.py": "from training.run import files\n",
    })
    assert check_layers(root) == [
        "training/process/faults.py:2: training.process imports training.run.files (part training.run)"]
    (root / "training/run/files.py").write_text("from training.loop.trainer import Trainer\n")
    assert check_layers(root)[-1] == "training/run/files.py:1: training.run imports training.loop.trainer (part training.loop)"


def test_the_checkpoint_format_is_private_to_the_store(tmp_path):
    root = _plant(tmp_path, {
        "training/__init__.py": "", "training/run/__init__.py": "", "training/run/dcp.py": "",
        "training/run/store.py": "from training.run import dcp\n",
        "training/loop/__init__.py": "",
        "training/loop/trainer.py": "from training.run.store import CheckpointStore\n",
    })
    assert check_layers(root) == []
    (root / "training/loop/trainer.py").write_text("from training.run.dcp import load_sharded\n")
    assert check_layers(root) == ["training/loop/trainer.py:1: training.run.dcp is private to training.run.store"]


def test_a_new_training_package_must_say_what_it_imports(tmp_path):
    root = _plant(tmp_path, {"training/__init__.py": "", "training/pipeline/__init__.py": "import model\n"})
    assert check_layers(root) == ["training/pipeline/__init__.py: training.pipeline is not a part of "
                                  "tests/test_import_layers.py's ALLOWED (say what it may import)"]


def test_every_training_package_says_what_it_owns():
    """A docstring at the top of each package (and top module) of training: what it owns and imports."""
    for part in (p for p in ALLOWED if p.startswith("training.")):
        path = ROOT / part.replace(".", "/")
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.relative_to(ROOT)} has no docstring"
    found = {f"training.{p.name}" for p in (ROOT / "training").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert found <= set(ALLOWED), found - set(ALLOWED)


# ----------------------------------------------------------------------------- the loop asks, never branches

# What names a parallel mode or a checkpoint format: the loop leaves both to the parallel plan and
# the checkpoint store.
LOOP_MAY_NOT_IMPORT = ("training.parallel.context", "training.parallel.data_parallel", "training.parallel.distributed",
                       "training.run.dcp", "torch.distributed", "torch.nn.parallel")
LOOP_MAY_NOT_READ = {"enabled", "cp_size", "cp_group", "is_sharded", "shards_state", "replicas", "parallel",
                     "context_parallel", "is_checkpoint_folder"}
LOOP_MAY_NOT_SAY = {"ddp", "fsdp", "dcp", ".dcp", ".pt"}


def check_loop(root: Path) -> list[str]:
    """One line per import, attribute or string in training/loop/ that names a parallel mode or a
    checkpoint format (docstrings aside)."""
    problems = []
    for path in sorted((root / "training" / "loop").glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef,
                      ast.FunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                names += [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
                problems += [f"{where}: imports {n}" for n in names if n.startswith(LOOP_MAY_NOT_IMPORT)]
            elif isinstance(node, ast.Attribute) and node.attr in LOOP_MAY_NOT_READ:
                problems.append(f"{where}: reads .{node.attr}")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and node.value in LOOP_MAY_NOT_SAY):
                problems.append(f"{where}: says {node.value!r}")
    return problems


def test_the_loop_names_no_parallel_mode_nor_checkpoint_format():
    assert check_loop(ROOT) == []


def test_a_loop_that_branches_on_the_mode_or_the_format_fails(tmp_path):
    root = _plant(tmp_path, {"training/loop/trainer.py": (
        '"""Mentions fsdp and .dcp in prose: fine."""\n'
        "from training.parallel.distributed import is_sharded\n"
        "def save(self):\n"
        "    if self.env.enabled and self.cfg.trainer.parallel == 'fsdp':\n"
        "        return self.run_dir / 'step.dcp'\n")})
    assert check_loop(root) == [
        "training/loop/trainer.py:2: imports training.parallel.distributed",
        "training/loop/trainer.py:2: imports training.parallel.distributed.is_sharded",
        "training/loop/trainer.py:4: reads .enabled",
        "training/loop/trainer.py:4: reads .parallel",
        "training/loop/trainer.py:4: says 'fsdp'",
    ]
