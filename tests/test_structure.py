"""The house rules that keep the code navigable, checked on the tree itself.

* The pipeline's stages import only downwards: no import cycle between top-level folders.

      core  <-  compat  <-  attention  <-  loss_head  <-  graph_capture  <-  solver  <-  runtime  <-  remat (API, CLI)

  Each folder may import its own modules and the folders to its left, never one to its right. Every
  `import remat.X` / `from remat.X import` in the package's files counts, function-local ones too.
* No import cycle between any two modules either (function-local imports count).
* The solver imports only core and itself, and no torch; core imports no other stage and no torch;
  PuLP is imported by one module, the MILP's backends (solver/checkmate/backends.py).
* No module imports another module's private names (`from remat.x import _name`, `x._name`).
* Every error remat defines is a RematError and every warning a RematWarning (core/errors.py).
* Every module has a docstring and an explicit `__all__`, and every public function or class in it
  has a docstring.
* No module is longer than ~400 lines unless its top says why ("Why this file is long:").

A stage's subpackages (solver/checkmate/) are held to the same rules as its modules.
"""
import ast
import importlib
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["core", "compat", "attention", "loss_head", "graph_capture", "solver", "runtime", "remat"]


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


def _files(layer: str) -> list[Path]:
    """The stage's Python files, its subpackages' included."""
    return sorted((ROOT / layer).rglob("*.py"))


def import_graph() -> dict[str, set[str]]:
    """folder -> the other folders its files import."""
    graph = {}
    for layer in LAYERS:
        deps = set()
        for path in _files(layer):
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
    """Every module's name, the subpackages' __init__ included (the stages' own are left out)."""
    return [_module_name(layer, p) for layer in LAYERS for p in _files(layer)
            if not (p.name == "__init__.py" and p.parent == ROOT / layer)]


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
        for path in _files(layer):
            lines = path.read_text().splitlines()
            if len(lines) > 420 and not any("Why this file is long:" in line for line in lines[:40]):
                long.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    assert not long, f"modules over ~400 lines without a reason at the top: {long}"


def _module_name(layer: str, path: Path) -> str:
    parts = list(path.relative_to(ROOT / layer).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["remat"] + ([] if layer == "remat" else [layer]) + parts)


def _module_files() -> dict[str, Path]:
    return {_module_name(layer, p): p for layer in LAYERS for p in _files(layer)}


def _imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The remat modules a file imports (`from remat.x import y` counts remat.x, and remat.x.y where
    that is a module), function-local imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {t for t in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if t in known}
    return out


def test_no_import_cycle_between_modules():
    import networkx as nx

    known = _module_files()
    g = nx.DiGraph()
    for name, path in known.items():
        g.add_node(name)
        g.add_edges_from((name, t) for t in _imported(path, known) if t != name)
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, f"modules that import each other (directly or through others): {cycles}"


def _third_party(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_solver_and_core_need_no_torch():
    bad = [str(p.relative_to(ROOT)) for layer in ("core", "solver") for p in _files(layer)
           if "torch" in _third_party(p)]
    assert not bad, f"these modules import torch (the solver sees only TrainingGraphs): {bad}"
    graph = import_graph()
    assert graph["core"] == set(), f"core imports other stages: {graph['core']}"
    assert graph["solver"] <= {"core"}, f"the solver imports stages other than core: {graph['solver']}"


def test_no_module_uses_another_modules_private_names():
    known = _module_files()
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in known and node.module != name:
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{name}: from {node.module} import {a.name}")
                    if f"{node.module}.{a.name}" in known:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    assert not found, f"private names used across modules: {found}"


def test_no_module_reaches_into_another_modules_objects():
    """A private method or attribute (`_name`) of a class is used only in the module that defines
    it: `rel._bases()` from another module is flagged as `from m import _bases` would be."""
    known = _module_files()
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in known.items()}
    own, members = {}, {}  # module -> the private names it defines; private member -> its modules
    for name, tree in trees.items():
        own[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own[name].add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own[name].add(node.attr)
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    members.setdefault(node.attr, set()).add(name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own[name].add(node.id)
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        members.setdefault(f.name, set()).add(name)
    found = sorted(f"{name}:{node.lineno} .{node.attr} (defined in {', '.join(sorted(members[node.attr]))})"
                   for name, tree in trees.items() for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                   and node.attr in members and node.attr not in own[name])
    assert not found, f"private members used outside their module: {found}"


def test_every_error_and_warning_has_remats_base():
    from remat.core.errors import RematError, RematWarning

    stray = []
    for name in _modules():
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name \
                    and not attr.startswith("_") and not issubclass(obj, (RematError, RematWarning)):
                stray.append(f"{name}.{attr}")
    assert not stray, f"errors and warnings without RematError / RematWarning as a base: {stray}"


def test_pulp_is_imported_only_by_the_milps_backends():
    importers = sorted(str(p.relative_to(ROOT)) for layer in LAYERS for p in _files(layer) if "pulp" in _third_party(p))
    assert importers == ["solver/checkmate/backends.py"], importers


def test_the_checks_see_subpackages():
    known = _module_files()
    assert "remat.solver.checkmate" in known and "remat.solver.checkmate.relaxation" in known
    assert "remat.solver.checkmate.milp_model" in _imported(known["remat.solver.checkmate.milp"], known)
