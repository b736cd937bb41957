"""Executor choice and its usage errors (the Ray run itself is tests/bench/test_ray_sweep.py)."""

from __future__ import annotations

import pytest
from cli_runner import run_cli

from scoutbench.bench.executors import LocalExecutor, RayExecutor, make_executor
from scoutbench.errors import UsageError


def test_make_executor():
    assert isinstance(make_executor("local", None), LocalExecutor)
    with pytest.raises(UsageError, match="--address is for --executor ray"):
        make_executor("local", "10.0.0.1:6379")
    with pytest.raises(UsageError, match="unknown --executor"):
        make_executor("dask", None)
    pytest.importorskip("ray")
    on_gpu = make_executor("ray", None, "cuda")
    assert isinstance(on_gpu, RayExecutor) and on_gpu.gpus_per_point(0) == 1 and on_gpu.cpus_per_point == 1
    auto = make_executor("ray", "head:6379", "auto", cpus_per_point=4)
    assert auto.cpus_per_point == 4 and auto.gpus_per_point(8) == 1 and auto.gpus_per_point(0) == 0
    assert make_executor("ray", None, "cpu").gpus_per_point(8) == 0


def test_sweep_cli_rejects_ray_options_without_ray_executor(tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--method", "fullkv", "--len", "256", "--cpus-per-point", "2",
                           "-o", tmp_path)
    assert code == 2 and "--cpus-per-point is for --executor ray" in err
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--method", "fullkv", "--len", "256", "--address", "h:1",
                           "-o", tmp_path)
    assert code == 2 and "--address is for --executor ray" in err
