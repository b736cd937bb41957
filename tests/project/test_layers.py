"""The import layers of the package (docs/architecture.md): kernels at the bottom, the runtime on them,
methods on both, the CLI on top, no import from a higher layer and no import circle anywhere, lazy
(function-level) imports included. Read from the source with `ast`, so a lazy import that breaks a layer is
caught without running it; imports only for type checkers do not count."""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import REPO_ROOT

ROOT = REPO_ROOT
# the installed package: scoutbench/, and methods/ and workloads/ as scoutbench.methods / scoutbench.workloads
PACKAGE_DIRS = {"scoutbench": "scoutbench", "methods": "scoutbench.methods", "workloads": "scoutbench.workloads"}
FOUNDATION = {"scoutbench.errors", "scoutbench.units", "scoutbench.registry", "scoutbench.cache",
              "scoutbench.environment", "scoutbench.input_files"}


def _module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [*PACKAGE_DIRS[folder].split("."), *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module) -> set[str]:
    """Every scoutbench module a file imports at run time (module level or inside a function), with the
    `from X import name` names as X.name too (a submodule import)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("scoutbench"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("scoutbench"))
    return found


def _graph() -> dict[str, set[str]]:
    files = [p for folder in PACKAGE_DIRS for p in (ROOT / folder).rglob("*.py")]
    imports = {_module_name(p): _runtime_imports(ast.parse(p.read_text(encoding="utf-8"))) for p in files}
    return {name: {m for m in found if m in imports and m != name} for name, found in imports.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def _outside(graph: dict[str, set[str]], layer: str, allowed: set[str]) -> list[str]:
    """`module -> import` pairs of a layer's modules that reach outside what the layer may use."""
    return sorted(f"{name} -> {dep}" for name, deps in graph.items() if name.startswith(layer)
                  for dep in deps if not any(dep == a or dep.startswith(a + ".") for a in allowed))


def test_no_import_circle():
    assert _circles(_graph()) == []


# The layers, bottom first (docs/architecture.md): a module imports only from its own layer and those below it. A
# name matches a module or a package (its longest listed prefix decides, so the synthetic workload's description sits
# below the engine, its K/V beside the engine that ingests them, and the text workloads above the models whose
# tokenizers they use).
LAYERS: list[tuple[str, set[str]]] = [
    ("foundation", {"scoutbench", *FOUNDATION}),
    ("kernels", {"scoutbench.kernels"}),
    ("runtime", {"scoutbench.runtime"}),
    ("methods", {"scoutbench.methods", "scoutbench.timing", "scoutbench.workloads.synthetic"}),
    ("testing", {"scoutbench.testing"}),
    ("core", {"scoutbench.decode", "scoutbench.models", "scoutbench.gguf_models", "scoutbench.results",
              "scoutbench.devices", "scoutbench.planning", "scoutbench.method_args", "scoutbench.telemetry",
              "scoutbench.profiling", "scoutbench.progress", "scoutbench.tiers", "scoutbench.step_stats",
              "scoutbench.resampling", "scoutbench.workloads.synthetic_kv"}),
    ("workloads", {"scoutbench.workloads"}),
    ("analysis", {"scoutbench.analysis"}),
    ("bench and eval", {"scoutbench.bench", "scoutbench.eval"}),
    ("api", {"scoutbench.api"}),
    ("cli", {"scoutbench.cli", "scoutbench.__main__"}),
]


def _layer_of(module: str) -> int:
    matches = [(len(prefix), rank) for rank, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)"
    return max(matches)[1]


def test_every_module_is_in_a_layer():
    for name in _graph():
        _layer_of(name)


def test_no_import_from_a_higher_layer():
    graph = _graph()
    upward = sorted(f"{name} ({LAYERS[_layer_of(name)][0]}) -> {dep} ({LAYERS[_layer_of(dep)][0]})"
                    for name, deps in graph.items() for dep in deps if _layer_of(dep) > _layer_of(name))
    assert upward == []


def test_kernels_import_only_kernels_and_the_foundation():
    assert _outside(_graph(), "scoutbench.kernels", {"scoutbench.kernels", *FOUNDATION}) == []


def test_runtime_imports_only_kernels_and_the_foundation():
    """Storage and transport sit on the compute kernels; a kernel never holds storage of its own (what allocates
    host or device tiers lives in the runtime), so the kernels stay importable on their own."""
    assert _outside(_graph(), "scoutbench.runtime", {"scoutbench.runtime", "scoutbench.kernels", *FOUNDATION}) == []


def test_methods_import_only_kernels_runtime_timing_and_the_foundation():
    """A method is built on the kernels, the runtime and the stage timer; it never reaches up into the engine, the
    benchmarks, the analysis or the CLI (those read the method's own declarations instead)."""
    allowed = {"scoutbench.methods", "scoutbench.kernels", "scoutbench.runtime", "scoutbench.timing", *FOUNDATION}
    assert _outside(_graph(), "scoutbench.methods", allowed) == []


def test_the_test_machinery_imports_only_kernels_timing_and_the_foundation():
    """Emulated CUDA stands in for torch.cuda under whatever runs on it; it knows the kernels' device caches and
    the stage timer's metadata calls, never the engine, a method or a benchmark."""
    allowed = {"scoutbench.testing", "scoutbench.kernels", "scoutbench.timing", *FOUNDATION}
    assert _outside(_graph(), "scoutbench.testing", allowed) == []


def test_only_the_cli_imports_the_test_machinery():
    """Test machinery stays out of the core: the CLI switches it on (`SCOUTBENCH_EMULATE_CUDA=1`), nothing else in
    the package reaches it."""
    graph = _graph()
    assert sorted(f"{name} -> {dep}" for name, deps in graph.items() for dep in deps
                  if dep.startswith("scoutbench.testing") and not name.startswith(("scoutbench.testing",
                                                                                    "scoutbench.cli"))) == []


def test_bench_and_eval_do_not_import_each_other():
    """Speed and accuracy are separate uses of the same engine; what both need lives below them."""
    graph = _graph()
    role = {name: name.split(".")[1] if name.count(".") else "" for name in graph}
    assert sorted(f"{name} -> {dep}" for name, deps in graph.items() for dep in deps
                  if {role[name], role[dep]} == {"bench", "eval"}) == []


def test_the_scan_sees_lazy_imports_and_skips_type_checking_ones():
    tree = ast.parse("import typing\nif typing.TYPE_CHECKING:\n    from scoutbench.x import A\n"
                     "def f():\n    from scoutbench.y import B\n")
    assert _runtime_imports(tree) == {"scoutbench.y", "scoutbench.y.B"}
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer_of("scoutbench.workloads.synthetic") < _layer_of("scoutbench.workloads.synthetic_kv") == _layer_of(
        "scoutbench.decode.engine") < _layer_of("scoutbench.workloads.longbench") < _layer_of(
        "scoutbench.bench.throughput")


# ------------------------------------------------------------------ no device branch in methods/
# what a condition on the compute device's kind (or on a backend's availability) reads
DEVICE_MARKERS = ("device.type", "is_cuda", "cuda", "_available(", '"cpu"', "'cpu'")
def _conditions(tree: ast.AST) -> list[ast.expr]:
    """Every expression a branch is taken on: if/while/ternary/assert tests, comprehension filters, and the
    operands-joined `a and b` / `a or b` (which branch as well)."""
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            found.append(node.test)
        elif isinstance(node, ast.comprehension):
            found.extend(node.ifs)
        elif isinstance(node, ast.BoolOp):
            found.append(node)
    return found


def _device_branches(path: Path) -> set[tuple[str, str]]:
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    branches = {(rel, ast.unparse(test)) for test in _conditions(tree)
                if any(marker in ast.unparse(test) for marker in DEVICE_MARKERS)}
    # a condition nested in a reported one (a BoolOp inside an if) is the same branch
    return {(f, text) for f, text in branches if not any(text != other and text in other for _, other in branches)}


def test_methods_branch_on_no_device_kind():
    """methods/ holds no branch on the compute device's kind or a backend's availability: a method chooses a
    runtime object once (the factories of runtime/cpu_part, token_fetch, selected_blocks and scout_selection) and
    calls one interface, so a next offloading method copies no CUDA-vs-CPU plumbing (issue 50)."""
    found = set().union(*(_device_branches(p) for p in sorted((ROOT / "methods").glob("*.py"))))
    assert found == set()


def test_the_device_branch_check_sees_each_form(tmp_path):
    """The check reports the forms a device branch takes (a device-type comparison, `is_cuda`, a flag named for
    CUDA, a backend's availability, a ternary) and not a device-neutral condition."""
    source = ("def f(x, y, dev):\n"
              "    if x.device.type == 'cuda':\n        pass\n"
              "    if y.is_cuda:\n        pass\n"
              "    on_cuda = dev.type == 'cuda'\n"
              "    z = 1 if on_cuda else 2\n"
              "    w = fused_ops_available(dev) and x\n"
              "    if x is None:\n        pass\n")
    (tmp_path / "m.py").write_text(source)
    module = tmp_path / "m.py"
    tree = ast.parse(module.read_text())
    tests = {ast.unparse(t) for t in _conditions(tree) if any(m in ast.unparse(t) for m in DEVICE_MARKERS)}
    assert tests == {"x.device.type == 'cuda'", "y.is_cuda", "on_cuda", "fused_ops_available(dev) and x"}
