"""What scoutbench caches (the compiled kernel library, converted GGUF models) is verified before it is used: a
corrupt cache never kills a command, and a build that hangs or is interrupted is bounded and leaves nothing behind.
Every probe runs on its own `SCOUTBENCH_CACHE` under tmp_path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from cli_runner import signal_once_started

from scoutbench import cache, gguf_models
from scoutbench.errors import ScoutbenchError
from scoutbench.kernels import cpu_attention


def _write_files(files: dict[str, bytes]):
    def build(folder: Path) -> None:
        for name, content in files.items():
            (folder / name).write_bytes(content)
    return build


def test_an_artefact_is_published_whole_and_rebuilt_when_it_does_not_verify(tmp_path):
    target = tmp_path / "thing"
    files = {"lib.so": b"\x7fELF" + bytes(range(256)) * 64, "config.json": b"{}"}
    assert cache.provide(target, _write_files(files)) == (target, None)
    assert cache.verify(target) is None and sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock", "thing"]
    os.truncate(target / "lib.so", 4096)
    assert cache.verify(target) == f"lib.so is 4096 bytes, {len(files['lib.so'])} expected"
    assert cache.provide(target, _write_files(files)) == (target, f"lib.so is 4096 bytes, {len(files['lib.so'])} "
                                                                  "expected")
    assert (target / "lib.so").read_bytes() == files["lib.so"]
    with open(target / "lib.so", "r+b") as handle:  # same size, one byte changed
        handle.seek(100)
        handle.write(b"\xff")
    assert cache.verify(target) == "lib.so does not match its digest"
    (target / "scoutbench-manifest.json").unlink()
    assert cache.verify(target) == "no manifest (an interrupted or older build)"
    (target / "scoutbench-manifest.json").write_text("{")
    assert cache.verify(target) == "an unreadable manifest (JSONDecodeError)"
    assert cache.provide(target, _write_files(files))[1] == "an unreadable manifest (JSONDecodeError)"
    assert cache.verify(target) is None


def test_a_failed_or_interrupted_build_leaves_nothing_and_a_killed_ones_leftovers_are_removed(tmp_path):
    target = tmp_path / "thing"

    def interrupted(folder: Path) -> None:
        (folder / "lib.so").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.provide(target, interrupted)
    assert [p.name for p in tmp_path.iterdir()] == [".thing.lock"]
    stale = tmp_path / ".thing.staging-killed"  # what a SIGKILLed builder leaves
    stale.mkdir()
    (stale / "lib.so").write_bytes(b"half")
    cache.provide(target, _write_files({"lib.so": b"whole"}))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock", "thing"]


# ---- the kernel library ------------------------------------------------------------------------------------------

def _fake_compiler(folder: Path, build: str) -> Path:
    """A `$CXX` that answers `--version` and runs the shell lines `build` for a compile, with $out the -o path."""
    script = folder / "fake-cxx"
    script.write_text('#!/bin/sh\ncase "$1" in --version) echo fake-cxx 1.0; exit 0;; esac\n'
                      'while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n' + build, encoding="utf-8")
    script.chmod(0o755)
    return script


@pytest.fixture
def built_library() -> Path:
    """This machine's verified kernel library (built once for the session's cache), for a fake compiler to copy."""
    compiler = cpu_attention._compiler()
    if compiler is None or cpu_attention.library() is None:
        pytest.skip("needs the kernel built (a C++ compiler)")
    return cpu_attention._build(compiler)


def test_a_truncated_cached_kernel_is_rebuilt_not_mapped(built_library, tmp_path, monkeypatch):
    """Truncated to 4096 bytes, the cached library was trusted by its name and mapped: every command died of SIGBUS
    (exit 135, no message), on every run. Loaded in a child process: a SIGBUS there must not end the test run."""
    copier = _fake_compiler(tmp_path, f'cp "{built_library}" "$out"\n')  # a fast, real build
    monkeypatch.setenv("SCOUTBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(copier))
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, "auto")
    cpu_attention._build(str(copier))  # the first build, not loaded in this process
    (library,) = (tmp_path / "cache").rglob("*.so")
    os.truncate(library, 4096)
    probe = ("import torch; from scoutbench.kernels import attention, cpu_attention; "
             "q, k = torch.randn(1, 2, 64), torch.randn(1, 2, 40, 64); "
             "state = attention.partial_attention(q, k, k, 0.125); print(cpu_attention.backend_name())")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.startswith("native-"), proc.stdout + proc.stderr
    assert proc.stderr.count("did not verify (cpu_attention.so is 4096 bytes") == 1, proc.stderr
    assert library.stat().st_size == built_library.stat().st_size


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie, killed and waiting to be reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_hung_compiler_is_bounded_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """A compiler that never returned stalled a run for 6 minutes (2 minutes per flag set); one whose child kept
    the output pipes open stalled it for as long as the child lived. Now the whole build has one deadline, the
    compiler's process group is killed at it, torch's kernels serve the run with one warning, and no temp file
    stays behind."""
    hang = _fake_compiler(tmp_path, f'echo partial > "$out"\nsleep 300 &\necho $! > "{tmp_path}/child"\n'
                                    f'echo $$ > "{tmp_path}/compiler"\nsleep 300\n')
    monkeypatch.setenv("SCOUTBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(hang))
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, "auto")
    monkeypatch.setattr(cpu_attention, "BUILD_TIMEOUT_S", 2)
    cpu_attention.library.cache_clear()
    start = time.monotonic()
    try:
        with pytest.warns(RuntimeWarning, match=r"unavailable \(fake-cxx did not finish within 2 s\); using torch"):
            assert cpu_attention.library() is None
    finally:
        cpu_attention.library.cache_clear()
    assert time.monotonic() - start < 30
    assert [p.name for p in (tmp_path / "cache" / "kernels").iterdir()] == [p.name for p in (
        tmp_path / "cache" / "kernels").glob(".*.lock")]
    for name in ("compiler", "child"):
        pid = int((tmp_path / name).read_text())
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), name


def test_sigterm_during_the_first_kernel_build_leaves_no_temp_file(tmp_path):
    """An interrupted build left its temp file in the cache."""
    started = tmp_path / "started"
    hang = _fake_compiler(tmp_path, f'echo partial > "$out"\ntouch "{started}"\nsleep 300\n')
    env = {**os.environ, "SCOUTBENCH_CACHE": str(tmp_path / "cache"), "CXX": str(hang),
           cpu_attention.ENV_BACKEND: "auto"}
    proc = subprocess.Popen([sys.executable, "-m", "scoutbench", "throughput", "--model", "tiny-qwen3", "--len",
                             "256", "--steps", "1", "--method", "fullkv", "-o", str(tmp_path / "out")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    signal_once_started(proc, started, 120, "the build never started", signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.decode()
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if not p.name.endswith(".lock")]
    assert leftovers == [tmp_path / "cache" / "kernels"], leftovers


# ---- converted GGUF models ---------------------------------------------------------------------------------------

@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A built-in GGUF model whose conversion writes three small files (and counts its runs)."""
    monkeypatch.setenv("SCOUTBENCH_CACHE", str(tmp_path))
    spec = gguf_models.GgufModel(name="fake", gguf_file="fake.gguf", parts=(), wheels="fake",
                                 context_window_tokens=1, saved_dtype=gguf_models.torch.float32)
    monkeypatch.setattr(gguf_models.GgufModel, "part_paths", lambda self: [])
    conversions = []

    def convert(spec, folder):
        conversions.append(folder)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (folder / name).write_bytes(b"{}" if name != "model.safetensors" else bytes(5000))

    monkeypatch.setattr(gguf_models, "_convert", convert)
    return spec, conversions


def test_a_truncated_converted_model_is_converted_again(fake_gguf):
    """The converted folder was trusted when its three files existed: a truncated model.safetensors failed every
    load (or mapped a short file)."""
    spec, conversions = fake_gguf
    folder = gguf_models.ensure_converted(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gguf_models.ensure_converted(spec) == folder and len(conversions) == 1  # verified: no second run
    os.truncate(folder / "model.safetensors", 100)
    with pytest.warns(RuntimeWarning, match=r"cached fake model .* did not verify \(model.safetensors is 100 bytes, "
                                            r"5000 expected\); converted it again"):
        gguf_models.ensure_converted(spec)
    assert len(conversions) == 2 and (folder / "model.safetensors").stat().st_size == 5000


def test_a_full_disk_during_the_first_conversion_is_one_line(fake_gguf, tmp_path, monkeypatch):
    """A full disk while saving the converted model was a safetensors traceback."""
    from safetensors import SafetensorError

    spec, _ = fake_gguf

    def disk_full(spec, folder):
        (folder / "config.json").write_text("{}")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(gguf_models, "_convert", disk_full)
    with pytest.raises(ScoutbenchError, match=rf"^cannot write the converted fake model under {tmp_path}: No space "
                                              "left on device \\(os error 28\\); free disk space or set "
                                              "SCOUTBENCH_CACHE to a folder with room for it$"):
        gguf_models.ensure_converted(spec)
    assert [p.name for p in tmp_path.iterdir()] == [".fake.lock"]


def test_the_cli_says_a_kernel_fallback_in_one_line(tmp_path, monkeypatch, capsys):
    """The fallback warning printed as Python's two lines (file:line: RuntimeWarning, then the source line)."""
    from cli_runner import run_cli

    monkeypatch.setenv("SCOUTBENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv(cpu_attention.ENV_BACKEND, "auto")
    cpu_attention.library.cache_clear()
    try:
        code, out, err = run_cli(monkeypatch, capsys, "throughput", "--model", "tiny-qwen3", "--len", "256",
                                 "--steps", "1", "--warmup", "0", "--method", "fullkv", "-o", tmp_path / "o")
    finally:
        cpu_attention.library.cache_clear()
    assert code == 0, err
    lines = [line for line in err.splitlines() if "attention kernel" in line or "cpu_attention" in line]
    assert lines == ["warning: CPU attention kernel unavailable (false failed: ?); using torch's kernels"], err
    assert "RuntimeWarning" not in err
