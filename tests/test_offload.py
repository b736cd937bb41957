"""The offload helpers' contracts: device caches from `device_zeros`, the CPU worker pool's GIL switch interval."""

from __future__ import annotations

import sys

import torch

from scoutbench.kernels.offload import WORKER_SWITCH_INTERVAL_S, CpuWorkerPool, device_zeros


def test_device_zeros_on_cpu_are_zeroed_views_of_one_arena():
    """On CPU every tensor is a zeroed view of one buffer (an arena, on huge pages where Linux allows them), with
    its own shape and dtype, and writing one leaves the others untouched."""
    specs = {("k", 0): ((2, 3, 40, 8), torch.float32), ("v", 0): ((2, 3, 40, 8), torch.bfloat16),
             "ids": ((5,), torch.long)}
    tensors = device_zeros(specs, torch.device("cpu"))
    assert list(tensors) == list(specs)
    for key, (shape, dtype) in specs.items():
        assert tensors[key].shape == shape and tensors[key].dtype == dtype
        assert tensors[key].is_contiguous() and torch.count_nonzero(tensors[key]) == 0
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storages) == 1
    tensors["k", 0].fill_(1.5)
    assert torch.count_nonzero(tensors["v", 0]) == 0 and torch.count_nonzero(tensors["ids"]) == 0


def test_worker_pools_lower_the_switch_interval_until_the_last_closes():
    """While any CpuWorkerPool is open the GIL switch interval is at most WORKER_SWITCH_INTERVAL_S; the last close
    (a second close of one pool counts once) restores the interval that was set before."""
    before = sys.getswitchinterval()
    already_open = CpuWorkerPool._open  # a pool another test left open keeps the interval low
    sys.setswitchinterval(0.004)
    try:
        first = CpuWorkerPool(1)
        assert sys.getswitchinterval() <= WORKER_SWITCH_INTERVAL_S * 1.0001
        second = CpuWorkerPool(1)
        assert second.submit(lambda: 6 * 7).result() == 42
        first.close()
        first.close()
        assert sys.getswitchinterval() <= WORKER_SWITCH_INTERVAL_S * 1.0001
        second.close()
        if already_open:
            assert sys.getswitchinterval() <= WORKER_SWITCH_INTERVAL_S * 1.0001
        else:
            assert abs(sys.getswitchinterval() - 0.004) < 1e-9
    finally:
        sys.setswitchinterval(before)
