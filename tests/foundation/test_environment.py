"""The environment variable registry (scoutbench/environment.py): every `SCOUTBENCH_*` name in the code is declared
there, read only through it, and checked at the start of every command and API run (a bad value: one line, exit 2,
before anything loads); docs/environment.md is the registry's table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from cli_runner import run_cli
from repo_paths import REPO_ROOT

from scoutbench import environment
from scoutbench.environment import FOREIGN, PREFIX, VARIABLES

ROOT = REPO_ROOT
# a name as code spells it; `_SCOUTBENCH_COMPLETE` (click's completion switch) is click's, not ours
NAME = re.compile(r"(?<![A-Za-z0-9_])" + PREFIX + r"[A-Z0-9_]*[A-Z0-9]")
CODE_SUFFIXES = {".py", ".sh", ".h", ".cpp", ".toml"}
CODE_FOLDERS = ("scoutbench", "methods", "workloads", "scripts", "benchmarks", "tests", "noxfile.py")


def _code_files() -> list[Path]:
    files = []
    for entry in CODE_FOLDERS:
        path = ROOT / entry
        files += [path] if path.is_file() else [p for p in path.rglob("*") if p.suffix in CODE_SUFFIXES]
    return files


def test_every_variable_the_code_names_is_declared():
    """A `SCOUTBENCH_*` name in any source, script or test that the registry does not declare (a new switch read
    with os.environ, or a typo) fails here."""
    undeclared = sorted({f"{path.relative_to(ROOT)}: {name}" for path in _code_files()
                         for name in NAME.findall(path.read_text(encoding="utf-8", errors="replace"))
                         if name not in VARIABLES})
    assert undeclared == []
    named = {name for path in _code_files() for name in NAME.findall(path.read_text(encoding="utf-8", errors="replace"))}
    assert set(VARIABLES) <= named  # nothing declared that no code reads


def _constants(tree: ast.Module) -> dict[str, str]:
    """A module's string constants (`ENV_BACKEND = "SCOUTBENCH_CPU_ATTENTION"`), by name."""
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}


def _environment_reads(tree: ast.Module) -> list[tuple[int, ast.expr]]:
    """(line, name expression) of every `os.environ.get(X)`, `os.getenv(X)`, `os.environ[X]`, `X in os.environ`."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv", "os.environ.pop",
                                                                     "os.environ.setdefault") and node.args:
            reads.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ" and \
                isinstance(node.ctx, ast.Load):  # a write (a benchmark choosing a backend) is no read
            reads.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(ast.unparse(c) == "os.environ" for c in node.comparators):
            reads.append((node.lineno, node.left))
    return reads


def test_the_code_reads_its_variables_only_through_the_registry():
    """Read with os.environ, a variable escapes the check at start (its bad value fails a run halfway, exit 1) and
    its parsing (a script read `SCOUTBENCH_EMULATE_CUDA` as `== "1"`, the registry takes 0 or 1)."""
    bypass = []
    for folder in ("scoutbench", "methods", "workloads", "scripts", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "scoutbench" / "environment.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            constants = _constants(tree)
            for line, expr in _environment_reads(tree):
                name = expr.value if isinstance(expr, ast.Constant) else constants.get(getattr(expr, "id", ""), "")
                if isinstance(name, str) and (name.startswith(PREFIX) or name in FOREIGN):
                    bypass.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert bypass == []


def test_every_example_value_is_valid_and_every_variable_has_two():
    from scoutbench.errors import EXIT_CODES

    for variable in [*VARIABLES.values(), *FOREIGN.values()]:
        assert variable.exit_code in EXIT_CODES, variable.name
        assert len(variable.examples) >= 1 and variable.meaning, variable.name
        for text in variable.examples:
            variable.parse(text)
    for variable in VARIABLES.values():  # the identity property test draws at least two distinct values of these
        if variable.decides_run:
            assert len({variable.parse(text) for text in variable.examples}) >= 2, variable.name


def _never(*args, **kwargs):
    raise AssertionError("a bad environment must be refused before anything loads")


@pytest.mark.parametrize("name, text, message", [
    ("SCOUTBENCH_DECODE_OPS", "bogus", "SCOUTBENCH_DECODE_OPS='bogus': use one of cpu-kernel, fused, hf"),
    ("SCOUTBENCH_DECODE_OPS", "", "SCOUTBENCH_DECODE_OPS is set but empty"),
    ("SCOUTBENCH_HOST_FILL_GIBS", "abc", "SCOUTBENCH_HOST_FILL_GIBS='abc': use a finite number >= 0"),
    ("SCOUTBENCH_HOST_FILL_GIBS", "nan", "SCOUTBENCH_HOST_FILL_GIBS='nan'"),
    ("SCOUTBENCH_EMULATE_CUDA_MEMORY_BYTES", "lots", "SCOUTBENCH_EMULATE_CUDA_MEMORY_BYTES='lots': use a size"),
    ("SCOUTBENCH_CPU_ATTENTION", "bogus", "SCOUTBENCH_CPU_ATTENTION='bogus': use one of auto, native, torch"),
    ("SCOUTBENCH_KERNEL_SPIN_US", "-5", "SCOUTBENCH_KERNEL_SPIN_US='-5': use an integer from 0"),
    ("SCOUTBENCH_EMULATE_CUDA", "yes", "SCOUTBENCH_EMULATE_CUDA='yes': use 1 (on) or 0 (off)"),
    ("SCOUTBENCH_TRACEBACK", "true", "SCOUTBENCH_TRACEBACK='true': use 1 (on) or 0 (off)"),
    (PREFIX + "CPU_ATTENTON", "torch", "not a scoutbench environment variable; did you mean SCOUTBENCH_CPU_ATTENTION?"),
])
def test_a_bad_environment_value_is_exit_2_before_anything_runs(name, text, message, tmp_path, monkeypatch, capsys):
    """`SCOUTBENCH_DECODE_OPS=bogus` (or empty) and `SCOUTBENCH_HOST_FILL_GIBS=abc` ended as a failed run, exit 1;
    `SCOUTBENCH_EMULATE_CUDA_MEMORY_BYTES=lots` was a ValueError traceback; a misspelt name was ignored."""
    monkeypatch.setenv(name, text)
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    code, out, err = run_cli(monkeypatch, capsys, "throughput", "--method", "fullkv", "--len", "64", "--steps", "1",
                             "--device", "cpu", "-o", tmp_path / "out")
    lines = err.strip().splitlines()
    declared = VARIABLES[name].exit_code if name in VARIABLES else 2
    assert code == declared == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not (tmp_path / "out").exists()


def test_the_python_api_checks_the_environment_first(monkeypatch):
    from scoutbench import api
    from scoutbench.errors import UsageError

    monkeypatch.setenv("SCOUTBENCH_DECODE_OPS", "bogus")
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    with pytest.raises(UsageError, match="SCOUTBENCH_DECODE_OPS='bogus'"):
        api.throughput(["fullkv"], length=64, steps=1, device="cpu")


def test_run_settings_are_the_parsed_values_of_the_deciding_variables(monkeypatch):
    for name in [*VARIABLES, *FOREIGN]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SCOUTBENCH_CPU_ATTENTION", " Torch ")
    monkeypatch.setenv("SCOUTBENCH_HOST_FILL_GIBS", "0.5")  # a test hook that decides nothing a run measures
    settings = environment.run_settings()
    assert settings["SCOUTBENCH_CPU_ATTENTION"] == "torch" and "SCOUTBENCH_HOST_FILL_GIBS" not in settings
    assert set(settings) == {name for name, v in {**VARIABLES, **FOREIGN}.items() if v.decides_run}


def test_docs_list_every_variable():
    """docs/environment.md's table is the registry's."""
    from scoutbench.environment import markdown_table

    text = (ROOT / "docs" / "environment.md").read_text(encoding="utf-8")
    assert markdown_table() in text
