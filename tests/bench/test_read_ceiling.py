"""benchmarks/read_ceiling.py: its bare reader reads exactly the bytes of a full call's stream and of a sparse call's
selected blocks, under every prefetch it tries (so its rates compare the kernel's two access patterns, byte for
byte)."""

from __future__ import annotations

import platform
import sys

import pytest
from repo_paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import read_ceiling  # noqa: E402

from scoutbench.kernels.cpu_attention import _compiler  # noqa: E402

pytestmark = pytest.mark.skipif(_compiler() is None or platform.machine() not in ("x86_64", "AMD64"),
                                reason="the reader needs a C++ compiler and an x86-64 CPU")


@pytest.mark.parametrize(("element", "block_size"), [(2, 32), (4, 32), (2, 16)])
def test_the_reader_reads_each_patterns_bytes_once(tmp_path, element, block_size):
    binary = read_ceiling.build(tmp_path)
    length, budget, rows, head_dim = 8192, 512, 8, 128
    counted = read_ceiling.bytes_read(binary, element, length, budget, block_size, rows, head_dim)
    full_bytes = 2 * rows * length * head_dim * element
    assert counted == {"stream": full_bytes,
                       **{f"sparse{ahead}": full_bytes * budget // length for ahead in read_ceiling.AHEADS}}
    rates = read_ceiling.read_rates(binary, element, length, budget, block_size, rows, head_dim)
    assert set(rates) == set(counted) and all(seconds > 0 and gbs > 0 for seconds, gbs in rates.values())
