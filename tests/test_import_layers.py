"""The layers import one way: kernels <- model <- training <- scripts/train.py, and data <- training.

kernels imports nothing of ours; model imports kernels only; data imports neither; training may
import all three; scripts/ and train.py sit on top. Every import is read with `ast`, those inside
functions included (a deferred import is still an arrow: it only hides the dependency until the
function runs), and the modules of one part must not import each other in a cycle. The checker is
a plain function so the tests below can feed it a planted tree and watch it fail.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What each top-level part of the checkout may import (besides itself).
ALLOWED = {
    "kernels": set(),
    "model": {"kernels"},
    "data": set(),
    "training": {"kernels", "model", "data"},
    "scripts": {"kernels", "model", "data", "training"},
    "train": {"kernels", "model", "data", "training"},
}


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


def check_layers(root: Path) -> list[str]:
    """One line per import against the layer order, and one per cycle among the modules of one part."""
    files = [root / "train.py"] if (root / "train.py").exists() else []
    for top in ALLOWED:
        if (root / top).is_dir():
            files += sorted((root / top).rglob("*.py"))
    modules = {_module_name(root, path): path for path in files}
    problems: list[str] = []
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        layer = name.split(".")[0]
        for target, line in sorted(_imports(tree, name, path.name == "__init__.py", set(modules)), key=lambda t: t[1]):
            target_layer = target.split(".")[0]
            where = f"{path.relative_to(root)}:{line}"
            if target_layer != layer and target_layer not in ALLOWED[layer]:
                problems.append(f"{where}: {layer} imports {target} (layer {target_layer})")
            if target_layer == layer and target != name:
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
        "training/trainer.py": "import model\n",
        "model/config.py": "def f():\n    from training.trainer import fit  # deferred, still an arrow\n",
    })
    assert check_layers(root) == ["model/config.py:2: model imports training.trainer (layer training)"]


def test_data_may_not_import_model_nor_kernels(tmp_path):
    root = _plant(tmp_path, {"data/__init__.py": "", "model/__init__.py": "", "kernels/masks.py": "",
                             "data/build.py": "from ..model import GPT\nimport kernels.masks\n"})
    assert check_layers(root) == ["data/build.py:1: data imports model (layer model)",
                                  "data/build.py:2: data imports kernels.masks (layer kernels)"]


def test_a_cycle_in_training_fails_even_through_a_deferred_import(tmp_path):
    root = _plant(tmp_path, {
        "training/__init__.py": "",
        "training/trainer.py": "from training.evaluate import evaluate\n",
        "training/evaluate.py": "def load():\n    from training import trainer\n",
    })
    assert check_layers(root) == ["import cycle: training.evaluate -> training.trainer -> training.evaluate"]
    (root / "training/evaluate.py").write_text("def load():\n    from training import checkpoint\n")
    (root / "training/checkpoint.py").write_text("")
    assert check_layers(root) == []
