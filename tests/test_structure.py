"""The house rules that keep the code navigable, checked on the tree itself.

* The pipeline's stages import only downwards: no import cycle between top-level folders.

      compat  <-  attention  <-  graph_capture  <-  solver  <-  runtime  <-  remat (API, CLI)

  Each folder may import its own modules and the folders to its left, never one to its right. Every
  `import remat.X` / `from remat.X import` in the package's files counts, function-local ones too.
* Every module has a docstring and an explicit `__all__`, and every public function or class in it
  has a docstring.
* No module is longer than ~400 lines unless its top says why ("Why this file is long:").
"""
import ast
import importlib
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["compat", "attention", "graph_capture", "solver", "runtime", "remat"]


def _imports(path: Path) -> set[str]:
    """The remat folders a file imports from (attention, solver, ..., or remat itself)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "remat":
                found.add(parts[1] if len(parts) > 1 and parts[1] in LAYERS[:-1] else "remat")
    return found


def import_graph() -> dict[str, set[str]]:
    """folder -> the other folders its files import."""
    graph = {}
    for layer in LAYERS:
        deps = set()
        for path in sorted((ROOT / layer).glob("*.py")):
            deps |= _imports(path)
        graph[layer] = deps - {layer}
    return graph


def test_every_stage_imports_only_the_stages_before_it():
    graph = import_graph()
    upward = {(a, b) for a, deps in graph.items() for b in deps if LAYERS.index(b) > LAYERS.index(a)}
    assert not upward, f"imports against the pipeline's order: {sorted(upward)}; graph: {graph}"


def test_the_check_sees_imports():
    graph = import_graph()
    assert "graph_capture" in graph["remat"] and "compat" in graph["graph_capture"]


def _modules() -> list[str]:
    return [f"remat.{layer}.{p.stem}" if layer != "remat" else f"remat.{p.stem}"
            for layer in LAYERS for p in sorted((ROOT / layer).glob("*.py")) if p.stem != "__init__"]


def test_every_module_and_public_name_is_documented():
    missing = []
    for name in _modules():
        mod = importlib.import_module(name)
        if not (mod.__doc__ or "").strip():
            missing.append(f"{name} (module docstring)")
        if not hasattr(mod, "__all__"):
            missing.append(f"{name} (__all__)")
            continue
        for public in mod.__all__:
            obj = getattr(mod, public)
            ours = getattr(obj, "__module__", "").startswith("remat")
            if ours and (inspect.isfunction(obj) or inspect.isclass(obj)) and not (obj.__doc__ or "").strip():
                missing.append(f"{name}.{public}")
    assert not missing, f"undocumented: {missing}"


def test_long_modules_say_why():
    long = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).glob("*.py")):
            lines = path.read_text().splitlines()
            if len(lines) > 420 and not any("Why this file is long:" in line for line in lines[:40]):
                long.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    assert not long, f"modules over ~400 lines without a reason at the top: {long}"
