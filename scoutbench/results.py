"""Result files: provenance, atomic writes (temp file + atomic claim of the name), the one-writer-per-folder lock,
and loading (with validation) for gates and reports."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scoutbench import __version__
from scoutbench.errors import ScoutbenchError, UsageError
from scoutbench.input_files import (
    UnusableFile,
    parse_json_bytes,
    read_regular_file,
    symlink_problem,
)
from scoutbench.result_schema import SCHEMA_VERSION, result_problem

# files with the envelope that are inputs or diagnostics, not results a gate, report or projection reads (a sweep
# folder holds the recall profiles it made); `load_results` passes over them
TOOL_OUTPUT_KINDS = ("scout_recall_profile", "scout_query_cosine", "selection_churn")
ENVELOPE_FIELDS = ("schema_version", "kind", "scoutbench_version", "created_at", "command", "env")


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def cli_command() -> list[str]:
    """argv as the user typed it, with the program named `scoutbench` whatever the entry point's path."""
    return ["scoutbench", *sys.argv[1:]]


def envelope(kind: str, command: list[str] | None = None, **env_extra: Any) -> dict[str, Any]:
    """The header every result file starts with, whatever its kind (docs/results.md, "Envelope"): what it is
    (`kind`, `schema_version`), what wrote it and when (`scoutbench_version`, `created_at`, `command`) and where
    (`env`, plus `env_extra` such as the scoring packages' versions). Built here only, so that every writer's
    provenance has the same fields."""
    return {"schema_version": SCHEMA_VERSION, "kind": kind, "scoutbench_version": __version__,
            "created_at": utc_now(), "command": list(command) if command is not None else cli_command(),
            "env": {**env_info(), **env_extra}}


# the package's own folder: `<checkout>/scoutbench` when scoutbench runs from its repository (a clone, an editable
# install), `.../site-packages/scoutbench` when installed, possibly inside someone else's repository (a `.venv/`)
PACKAGE_DIR = Path(__file__).resolve().parent


def _git(*args: str, cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd or PACKAGE_DIR, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _own_checkout() -> bool:
    """True when the package is scoutbench's own source in its repository: tracked by git, at `scoutbench/` below
    the repository's root. Installed into another repository (a virtual environment inside a user's checkout),
    the package is neither, and that repository's commit is not scoutbench's."""
    prefix = _git("rev-parse", "--show-prefix")
    return prefix is not None and prefix.strip() == "scoutbench/" and \
        _git("ls-files", "--error-unmatch", "--", Path(__file__).name) is not None


def git_commit() -> str | None:
    """The commit of scoutbench's own checkout when the package runs from one (an installed wheel has none, in or
    out of another repository: then the package version is the provenance)."""
    if not _own_checkout():
        return None
    out = _git("rev-parse", "HEAD")
    return out.strip() or None if out is not None else None


def git_dirty() -> bool | None:
    """True when tracked files differ from that commit (the code that ran is not the commit's); None outside
    scoutbench's own checkout. Untracked files (results, caches) do not count."""
    if git_commit() is None:
        return None
    out = _git("status", "--porcelain", "--untracked-files=no")
    return None if out is None else bool(out.strip())


def workdir_git(cwd: Path | None = None) -> dict[str, Any] | None:
    """The repository the command ran in (the working directory's), when it is not scoutbench's own checkout:
    `{"commit", "dirty"}` of the user's experiment code; None outside a repository."""
    folder = Path.cwd() if cwd is None else cwd
    top = _git("rev-parse", "--show-toplevel", cwd=folder)
    if top is None or (_own_checkout() and Path(top.strip()) == PACKAGE_DIR.parent):
        return None
    commit = _git("rev-parse", "HEAD", cwd=folder)
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=folder)
    return {"commit": commit.strip() or None if commit is not None else None,
            "dirty": None if status is None else bool(status.strip())}


@functools.cache
def torch_env_summary() -> str:
    """torch's own environment report (`python -m torch.utils.collect_env`, lm-eval's `pretty_env_info`): driver,
    CUDA/cuDNN, CPU flags, pip packages. About 2 s, so computed once per process."""
    try:
        from torch.utils.collect_env import get_pretty_env_info

        return get_pretty_env_info()
    except Exception as exc:  # noqa: BLE001 - a report that fails is recorded as such, never fails a run
        return f"unavailable: {type(exc).__name__}: {exc}"


def env_info() -> dict[str, Any]:
    """Versions and host facts recorded with every result (fields: docs/results.md, "Provenance")."""
    import torch
    import transformers

    from scoutbench.devices import cpu_model, resolve_device
    from scoutbench.kernels import cpu_attention
    from scoutbench.kernels.backends import flashinfer_status, partial_backend, triton_status
    from scoutbench.telemetry import nvml_device_info

    info: dict[str, Any] = {
        "scoutbench": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
        "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda, "flashinfer": flashinfer_status(), "triton": triton_status(),
        "partial_attention_backend": partial_backend(resolve_device("auto")),
        "cpu_attention_backend": partial_backend(torch.device("cpu")),  # host-side attention (CPU parts), on every device
        "git_commit": git_commit(), "git_dirty": git_dirty(), "workdir_git": workdir_git(),
        "host": socket.gethostname(), "platform": platform.platform(), "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the ISA torch's CPU kernels dispatch to
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "kernel_helper_spin_us": cpu_attention.helper_spin_us(),  # the CPU kernel pool's (docs/platform.md)
    }
    if torch.cuda.is_available():
        info["gpu_name"] = torch.cuda.get_device_name()
        info["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        info["gpu"] = nvml_device_info(torch.cuda.current_device())  # driver, UUID, power limit, throttling
    info["torch_env_summary"] = torch_env_summary()
    return info


def json_text(obj: Any, indent: int | None = 2) -> str:
    """`obj` as strict JSON text for stdout (`--json`), as the result files are written: a non-finite float as the
    string "nan"/"inf"/"-inf", never the `NaN`/`Infinity` that Python's json writes and other readers refuse."""
    return json.dumps(_jsonable(obj), indent=indent, allow_nan=False, default=str)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)  # "inf"/"nan": strict JSON has no infinities (as vLLM does)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def describe_os_error(exc: OSError, path: str | Path | None = None) -> str:
    """An OS error as one line: what went wrong and where (a symlink loop or broken link named as such)."""
    path = path if path is not None else exc.filename
    link = symlink_problem(path) if path is not None else None
    if link is not None:
        return link
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"{reason} ({path})" if path is not None else reason


def _os_error(action: str, path: Path, exc: OSError) -> ScoutbenchError:
    """One line for an OS failure (disk full, read-only, a folder where a file should be): exit 1."""
    reason = symlink_problem(path) or exc.strerror or str(exc)
    return ScoutbenchError(f"cannot {action} {path}: {reason}; free space or choose another -o")


def _write_temp(path: Path, obj: Any, indent: int | None = 2) -> Path:
    """The JSON, complete and fsynced, in a temp file beside `path` (same filesystem, so renames are atomic);
    `indent` None writes it compact, through json's C encoder (its indenting encoder is pure Python)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _os_error("write results to", path, exc) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            try:
                text = json.dumps(obj, indent=indent, allow_nan=False)
            except (ValueError, TypeError):  # a non-finite float (or a key json cannot take): converted first
                text = json.dumps(_jsonable(obj), indent=indent, allow_nan=False)
            handle.write(text)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; results are meant to be shared
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _os_error("write results to", path, exc) from None
        raise
    return Path(tmp)


def _claim(tmp: Path, path: Path) -> bool:
    """Move the finished temp file to `path` only if no file has that name: a hard link fails atomically when the
    name is taken, so two writers can never both think they got it (no check-then-rename race). False if taken."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as exc:
        if isinstance(exc, IsADirectoryError) or path.is_dir():
            raise _os_error("write results to", path, IsADirectoryError(21, "it is a folder")) from None
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise _os_error("write results to", path, exc) from None
        # a filesystem without hard links: claim the name with O_EXCL, then replace the empty placeholder
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError as inner:
            raise _os_error("write results to", path, inner) from None
        os.replace(tmp, path)
        return True
    tmp.unlink(missing_ok=True)
    return True


def write_json_atomic(path: str | Path, obj: Any, overwrite: bool = False, indent: int | None = 2) -> Path:
    """Write JSON through a temp file in the same folder and move it into place: a reader never sees a partial
    file, an interrupted write leaves only an ignorable `.tmp` file, and an OS error (disk full, read-only, the
    name is a folder) is one line with exit code 1 and leaves nothing behind. Without `overwrite` an existing
    file is never replaced, even by a writer that races this one."""
    path = Path(path)
    if path.is_dir():
        raise _os_error("write results to", path, IsADirectoryError(21, "it is a folder"))
    if path.exists() and not overwrite:
        raise UsageError(f"{path} exists; pass --overwrite to replace it or choose another -o")
    tmp = _write_temp(path, obj, indent)
    try:
        if overwrite:
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise _os_error("write results to", path, exc) from None
        elif not _claim(tmp, path):
            raise UsageError(f"{path} exists; pass --overwrite to replace it or choose another -o")
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json_unique(path: str | Path, obj: Any) -> Path:
    """Write to `name.json`, or `name-1.json`, `name-2.json`, ... if taken, claiming the name atomically:
    results are never overwritten, even by a concurrent writer. Returns the path written."""
    path = Path(path)
    tmp = _write_temp(path, obj)
    try:
        index = 0
        while True:
            candidate = path if index == 0 else path.with_name(f"{path.stem}-{index}{path.suffix}")
            if _claim(tmp, candidate):
                return candidate
            index += 1
    finally:
        tmp.unlink(missing_ok=True)


def check_writable(path: str | Path, overwrite: bool = True, single_file: bool | None = None) -> None:
    """Fail before a long run, not after it: an output that cannot be written (OS error: exit 1), a file output
    that is a folder (exit 1), or one that exists without `overwrite` (usage error: exit 2). Creates the folder.
    `path` is a file when `single_file`, or by default when it ends in .json; otherwise a folder."""
    path = Path(path)
    single_file = path.suffix == ".json" if single_file is None else single_file
    folder = path.parent if single_file else path
    link = symlink_problem(path)
    if link is not None:
        raise ScoutbenchError(f"cannot write results under {path}: {link}; choose another -o")
    if single_file and path.is_dir():
        raise ScoutbenchError(f"cannot write results to {path}: it is a folder; choose a file name or a folder "
                              "without .json for -o")
    if not single_file and path.exists() and not path.is_dir():
        raise ScoutbenchError(f"cannot write results under {path}: it is a file, not a folder; choose another -o")
    if single_file and path.exists() and not overwrite:
        raise UsageError(f"{path} exists; pass --overwrite to replace it or choose another -o")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ScoutbenchError(f"cannot write results under {path}: {exc.strerror or exc}; choose another -o") from None


LOCK_NAME = ".scoutbench.lock"


@contextlib.contextmanager
def output_lock(folder: str | Path) -> Iterator[None]:
    """Hold the folder's writer lock for the duration: one scoutbench run writes into a folder at a time, so a
    second sweep or throughput cannot delete the first's temp files or race it for result names. The lock is an
    OS file lock (`filelock`), released by the kernel when a run is killed: a stale lock cannot block reruns."""
    from filelock import FileLock, Timeout

    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(folder / LOCK_NAME), timeout=0)
        lock.acquire()
    except Timeout:
        raise ScoutbenchError(f"another scoutbench run is writing to {folder}; wait for it to finish or choose "
                              "another -o") from None
    except OSError as exc:
        reason = symlink_problem(folder) or exc.strerror or exc
        raise ScoutbenchError(f"cannot lock {folder}: {reason}; choose another -o") from None
    try:
        yield
    finally:
        lock.release()


def result_files(paths: Iterable[str | Path]) -> Iterator[Path]:
    """The candidate result files under `paths`: a file as given, a folder's `*.json` files at any depth (symlinked
    folders are not walked: a link loop would never end), sweep manifests and hidden (temp) files left out."""
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise UsageError(f"no such result file or folder: {symlink_problem(path) or path}")
        if not path.is_dir():
            yield path
            continue
        for file in sorted(path.rglob("*.json")):
            if not file.name.startswith(".") and file.name != "sweep.json" and not file.is_dir():
                yield file


def load_results(paths: Iterable[str | Path],
                 on_skip: Callable[[Path, str], None] | None = None) -> list[dict[str, Any]]:
    """Result JSON files from files and folders (recursively); sweep manifests and temp files are skipped.

    Each file is read once: a file reached twice (a folder and a file in it, a symlink beside its target) counts
    once, and a byte-identical copy under another name is no second repeat of a measurement (listed, not merged).
    Only regular files are read (`read_json_file`: bounded in size and nesting). A file that cannot be used (not a
    regular file, unreadable, malformed, wrong field types, a copy) raises a UsageError naming the file, unless
    `on_skip(file, reason)` is given: then it, and any JSON file that is not a scoutbench result, is reported there
    and skipped (reports and gates list what they left out and why).
    """
    results: list[dict[str, Any]] = []
    by_content: dict[str, Path] = {}

    def skip(file: Path, reason: str) -> None:
        if on_skip is None:
            raise UsageError(f"cannot read result {file}: {reason}")
        on_skip(file, reason)

    names: dict[str, list[Path]] = {}  # resolved path -> the names it was reached by, in order
    for file in result_files(paths):
        names.setdefault(os.path.realpath(file), []).append(file)
    for real, reached in names.items():
        # read under its own name where it was reached by it (not through a link); other names are listed
        file = next((f for f in reached if os.path.abspath(f) == real), reached[0])
        for other in dict.fromkeys(reached):
            if other != file:  # a link or a second name of one file; the same name twice says nothing
                skip(other, f"the same file as {file} (read once)")
        try:
            content = read_regular_file(file)
            data = parse_json_bytes(content)
        except UnusableFile as exc:
            skip(file, str(exc))
            continue
        if isinstance(data, dict) and data.get("kind") in TOOL_OUTPUT_KINDS:
            if on_skip is not None:
                on_skip(file, f"kind {data['kind']!r} is a tool's output, not a measured result")
            continue
        problem = result_problem(data)
        if problem is not None:
            if on_skip is not None:
                on_skip(file, problem)
            elif isinstance(data, dict) and "schema_version" in data:  # other JSON files are not ours to judge
                raise UsageError(f"{file}: {problem}; fix or remove it")
            continue
        digest = hashlib.sha256(content).hexdigest()
        if digest in by_content:  # a copy is the same run, not a repeat: merging it would double its weight
            skip(file, f"byte-identical to {by_content[digest]}: a copy of one run, counted once")
            continue
        by_content[digest] = file
        data.setdefault("_path", str(file))
        results.append(data)
    return results
