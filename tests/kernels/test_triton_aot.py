"""The Triton kernels' launch configurations on real GPU targets, compiled ahead without a GPU (scripts/triton_aot.py,
which `nox -s aot` runs over every specialisation with triton 3.9 and 3.6). Here: the configurations that once failed
a target, each compiled for it. fp32 decode in 64-key tiles and 3 stages needed 143 KiB of shared memory (over the
99 KiB of sm_86/sm_89: it would not load there) and spilled on sm_90; the fp32 region kernel spilled 6.6/8.5 KB on
sm_90; the select kernel spilled on sm_90 at a budget of 4096 (its [S_PAD, K_PAD] slot comparison) and, with triton
3.6, at its largest rows (16384 blocks). Skipped where triton is not installed."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from repo_paths import REPO_ROOT

pytest.importorskip("triton")

ROOT = REPO_ROOT


@pytest.fixture(scope="module")
def aot(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("triton_aot", ROOT / "scripts" / "triton_aot.py")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))  # compiled afresh
        patch.setitem(sys.modules, "triton_aot", module)  # its dataclasses look their module up
        spec.loader.exec_module(module)
        yield module


FAILED_BEFORE = [
    (86, "decode", {"dtype": torch.float32}),  # 143 KiB of shared memory > 99 KiB
    (90, "decode", {"dtype": torch.float32}),  # 255 registers, 596/500 B spilled
    (90, "region", {"dtype": torch.float32}),  # blocks of 16: 6.6/8.5 KB spilled
    (90, "region", {"dtype": torch.float32, "block_size": 32}),
    (90, "select", {"budget": 4096}),  # bf16 too: 3.8/3.8 KB spilled
    (90, "select", {"context": 128 * 1024}),  # 16384 blocks: spilled with triton 3.6
]


@pytest.mark.parametrize(("capability", "kernel", "case"), FAILED_BEFORE,
                         ids=[f"sm_{cc}-{k}-{'-'.join(map(str, c.values()))}" for cc, k, c in FAILED_BEFORE])
def test_a_configuration_that_failed_a_target_fits_it(aot, capability, kernel, case):
    results = aot.compile_target(capability, (kernel,), [aot.Case(**case)])
    assert results and not [(r.site, r.problems) for r in results if r.problems]
    assert all(r.shared_bytes <= aot.SHARED_LIMIT_BYTES[capability] for r in results)
