"""Dependency hygiene: `--help` imports no torch, the GGUF cache lock, the hub probe, the pytest
marker policy and the flashinfer API range."""

import http.server
import importlib.util
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

from scoutbench.cli import COMMANDS

REPO = REPO_ROOT

HELP_PROBE = textwrap.dedent("""
    import sys
    from scoutbench.cli import cli
    try:
        cli.main([*sys.argv[1:], "--help"], standalone_mode=False, prog_name="scoutbench")
    except SystemExit:
        pass
    heavy = sorted(name for name in ("torch", "transformers", "numpy") if name in sys.modules)
    print("HEAVY:" + ",".join(heavy), file=sys.stderr)
""")


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_imports_no_torch(command):
    """`scoutbench CMD --help` must be instant: `throughput --help` once imported torch (~2 s, 228 MB)
    through tiers.py's type annotation, and sweep/report/gate through the sweep module."""
    proc = subprocess.run([sys.executable, "-c", HELP_PROBE, *([command] if command else [])], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert "Usage:" in proc.stdout, proc.stderr
    heavy = proc.stderr.strip().splitlines()[-1]
    assert heavy == "HEAVY:", f"`scoutbench {command} --help` imported {heavy.removeprefix('HEAVY:')}"


RUN_PROBE = textwrap.dedent("""
    import sys

    class NoTorch:  # torch (and what would pull it in) is not importable: a command that needs it fails
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers"):
                raise ImportError(f"{name} imported by a command documented as torch-free")

    sys.meta_path.insert(0, NoTorch())
    sys.argv = ["scoutbench", *sys.argv[1:]]
    from scoutbench.cli import main
    main()
""")


def _torch_free_commands(folder: Path) -> list[list[str]]:
    return [["export", str(folder), "--format", "csv", "-o", str(folder.parent / "out.csv")],
            ["export", str(folder), "--format", "vllm", "-o", str(folder.parent / "vllm")],
            ["gate", "--current", str(folder), "--ratio", "scout/fullkv>=1.5"],
            ["gate", "--baseline", str(folder), "--current", str(folder)],
            ["accuracy", "--dataset", "list"]]


@pytest.mark.parametrize("index", range(5))
def test_commands_documented_torch_free_run_without_torch(index, tmp_path):
    """docs/results.md says export, gate (but --counters) and `accuracy --dataset list` import no torch: each
    imported it through results.py's device helpers, and the dataset list through the passkey workload."""
    sys.path.insert(0, str(REPO / "tests"))
    from result_factory import SCOUT_CONFIG, make_result, write_results

    folder = write_results(tmp_path / "runs", [make_result("fullkv", 40.0),
                                               make_result("scout", 80.0, config=SCOUT_CONFIG)])
    args = _torch_free_commands(folder)[index]
    proc = subprocess.run([sys.executable, "-c", RUN_PROBE, *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, f"scoutbench {' '.join(args)}: {proc.stderr[-2000:]}"


# ---------------------------------------------------------------------------------------------- GGUF cache lock
def test_concurrent_first_uses_convert_once(tmp_path, monkeypatch):
    """Two first uses at once: the filelock makes the second wait for the first and find the folder complete."""
    from scoutbench import gguf_models

    monkeypatch.setenv("SCOUTBENCH_CACHE", str(tmp_path))
    spec = gguf_models.GgufModel(name="fake", gguf_file="fake.gguf", parts=(), wheels="fake",
                                 context_window_tokens=1, saved_dtype=gguf_models.torch.float32)
    monkeypatch.setattr(gguf_models.GgufModel, "part_paths", lambda self: [])
    conversions = []
    inside = threading.Event()

    def slow_convert(spec, staging):
        conversions.append(staging)
        inside.set()
        threading.Event().wait(0.3)  # the other thread arrives while this one holds the lock
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (staging / name).write_text("x")

    monkeypatch.setattr(gguf_models, "_convert", slow_convert)
    first = threading.Thread(target=gguf_models.ensure_converted, args=(spec,))
    first.start()
    assert inside.wait(10)
    assert gguf_models.ensure_converted(spec) == tmp_path / "fake"  # blocks on the lock, then finds it complete
    first.join()
    assert len(conversions) == 1 and sorted(p.name for p in tmp_path.iterdir()) == [".fake.lock", "fake"]


# ---------------------------------------------------------------------------------------------- hub probe
class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_HEAD(self):  # noqa: N802 - http.server's naming
        type(self).seen.append(self.requestline)
        self.send_response(404)  # any answer means "reachable"
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def local_server():
    _Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def fresh_hub_session(monkeypatch):
    """huggingface_hub builds its HTTP client once (reading proxies then): drop it so the test's env applies."""
    from huggingface_hub.utils import close_session

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY",
                 "http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    close_session()
    yield monkeypatch
    close_session()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_hub_probe_uses_hf_endpoint(local_server, fresh_hub_session):
    from scoutbench.models import hub_offline, hub_reachable

    fresh_hub_session.setenv("HF_ENDPOINT", f"http://127.0.0.1:{local_server.server_port}")
    assert hub_reachable() and not hub_offline()
    assert _Recorder.seen and _Recorder.seen[0].startswith("HEAD / ")
    fresh_hub_session.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    assert not hub_reachable(timeout_s=2.0)


def test_hub_probe_goes_through_the_proxy(local_server, fresh_hub_session):
    """An endpoint only the proxy can reach (`.invalid` never resolves): reachable exactly when HTTP_PROXY is used."""
    from scoutbench.models import hub_reachable

    fresh_hub_session.setenv("HF_ENDPOINT", "http://hub.invalid")
    fresh_hub_session.setenv("HTTP_PROXY", f"http://127.0.0.1:{local_server.server_port}")
    assert hub_reachable()
    assert _Recorder.seen == ["HEAD http://hub.invalid/ HTTP/1.1"]


@pytest.mark.parametrize("name,value", [("HF_HUB_OFFLINE", "1"), ("HF_HUB_OFFLINE", "true"),
                                        ("TRANSFORMERS_OFFLINE", "YES")])
def test_offline_env_skips_the_probe(name, value, local_server, fresh_hub_session):
    from scoutbench.models import hub_offline

    fresh_hub_session.setenv("HF_ENDPOINT", f"http://127.0.0.1:{local_server.server_port}")
    fresh_hub_session.setenv(name, value)
    assert hub_offline()
    assert _Recorder.seen == []  # not even asked


# ---------------------------------------------------------------------------------------------- pytest markers
def test_unregistered_marker_is_an_error_and_slow_selects_the_qwen_tests(tmp_path):
    typo = tmp_path / "test_typo.py"
    typo.write_text("import pytest\n\n@pytest.mark.slwo\ndef test_x():\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-c", str(REPO / "pyproject.toml"),
                           "--rootdir", str(REPO), str(typo)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "'slwo' not found in `markers` configuration option" in proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", "-p", "no:cacheprovider",
                           "tests/engine/test_engine.py", "tests/models/test_gguf_models.py", "tests/eval/test_passkey.py"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    selected = [line for line in proc.stdout.splitlines() if "::" in line]
    qwen = [line for line in selected if "qwen25" in line]  # what nox tests_qwen adds, among the real-model tests
    assert len(qwen) == 4 and not any("[tiny_" in line for line in selected), proc.stdout


# ---------------------------------------------------------------------------------------------- flashinfer range
def _checker():
    spec = importlib.util.spec_from_file_location("check_flashinfer_api", REPO / "scripts" / "check_flashinfer_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMPATIBLE = '''
class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False): ...
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *deprecated, **kwargs): ...
    def _plan_impl(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                   q_data_type=None, kv_data_type=None, sm_scale=None): ...
    def run(self, q, paged_kv_cache, *, out=None, lse=None, return_lse=False): ...
'''
UTILS_CUH = "#define DISPATCH_GQA_GROUP_SIZE(group_size, G, ...) " + " ".join(
    f"if (group_size == {g}) {{}}" for g in (1, 2, 3, 4, 8)) + "\n#define OTHER\n"


def test_flashinfer_api_check_accepts_the_adapter_api_and_names_what_is_missing():
    check = _checker()
    assert check.api_problems(COMPATIBLE, UTILS_CUH) == []
    assert check.compiled_group_sizes(UTILS_CUH) == (1, 2, 3, 4, 8)
    renamed = COMPATIBLE.replace("use_tensor_cores=False", "tensor_cores=False").replace("sm_scale=None", "scale=None")
    assert check.api_problems(renamed) == ["BatchDecodeWithPagedKVCacheWrapper() has no parameter 'use_tensor_cores'",
                                           "plan() takes no keyword 'sm_scale'"]
    fewer = UTILS_CUH.replace("if (group_size == 8) {}", "")
    assert check.api_problems(COMPATIBLE, fewer)[0].startswith("DISPATCH_GQA_GROUP_SIZE compiles group sizes (1, 2, 3, 4)")
    assert check.api_problems("class Other: pass") == ["no class BatchDecodeWithPagedKVCacheWrapper in flashinfer/decode.py"]


def test_installed_flashinfer_is_in_the_checked_range():
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip('flashinfer is not installed (pip install "scoutbench[gpu]")')
    assert _checker().main([]) == 0


def test_every_package_is_installed():
    """pyproject's explicit package list does not pick up subpackages: a folder missing from it (scoutbench.cli
    was) is absent from a non-editable install, whose `scoutbench` command then fails to import."""
    import tomllib

    root = REPO_ROOT
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = {"scoutbench": root / "scoutbench", **{name: root / path for name, path in config["package-dir"].items()}}
    found = {".".join((top, *init.parent.relative_to(folder).parts))
             for top, folder in folders.items() for init in folder.rglob("__init__.py")}
    assert sorted(found) == sorted(config["packages"])
