"""The package's layers, checked: import-linter's contracts (pyproject.toml), no import cycle between any
two modules (type-only imports included), no private name used across modules, and what importing a
layer loads in a fresh interpreter."""

import ast
import json
import os
import pathlib
import subprocess
import sys
import sysconfig

import grimp

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    lint = pathlib.Path(sysconfig.get_path("scripts")) / "lint-imports"
    done = subprocess.run([str(lint), "--no-cache", "pyproject.toml"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycle_between_modules():
    graph = grimp.build_graph("orca_jax", cache_dir=None)  # TYPE_CHECKING imports included
    assert "orca_jax.core.sched.scheduler" in graph.modules
    edges = {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    assert _cycles(edges) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _private_uses(path: pathlib.Path) -> list[str]:
    """`from orca_jax.x import _name`, and `module._name` on an orca_jax module imported by name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules, found = {}, []
    private = lambda name: name.startswith("_") and not name.endswith("__")  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("orca_jax"):
            for alias in node.names:
                if private(alias.name):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
                submodule = ROOT / (node.module.replace(".", "/") + "/" + alias.name)
                if submodule.is_dir() or submodule.with_suffix(".py").exists():
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            modules.update({alias.asname or alias.name: alias.name for alias in node.names
                            if alias.name.startswith("orca_jax")})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and private(node.attr):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_used_across_modules():
    files = sorted((ROOT / "orca_jax").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    assert len(files) > 100
    assert [use for path in files for use in _private_uses(path)] == []


def _loaded_by(*modules: str) -> set[str]:
    """The modules a fresh interpreter holds after importing `modules` (from this checkout)."""
    code = f"import json, sys\nfor m in {list(modules)!r}: __import__(m)\nprint(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return set(json.loads(done.stdout))


def _jax_or(loaded: set[str], *packages: str) -> set[str]:
    return {m for m in loaded if m.split(".")[0] in ("jax", "jaxlib", "flax")
            or any(m == p or m.startswith(p + ".") for p in packages)}


def test_core_and_the_request_side_load_no_jax_in_a_fresh_process():
    loaded = _loaded_by("orca_jax", "orca_jax.core.sched.scheduler", "orca_jax.core.sched.policies",
                        "orca_jax.core.kv.manager", "orca_jax.sample.batcher", "orca_jax.engine.input_processor",
                        "orca_jax.engine.output_processor")
    assert "orca_jax.core.sched.scheduler" in loaded
    assert _jax_or(loaded, "orca_jax.worker", "orca_jax.engine.core", "orca_jax.server", "orca_jax.models") == set()


def test_the_server_package_loads_no_app_in_a_fresh_process():
    loaded = _loaded_by("orca_jax.server")
    assert {m for m in loaded if m.startswith("orca_jax.server.")} == set()
    assert _jax_or(loaded) == set()


def test_the_grammar_workers_module_loads_no_jax_in_a_fresh_process():
    loaded = _loaded_by("orca_jax.structured.sandbox")
    assert _jax_or(loaded, "orca_jax.worker", "orca_jax.engine", "orca_jax.server", "orca_jax.models") == set()
