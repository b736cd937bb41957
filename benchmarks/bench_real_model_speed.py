"""Prefill and FullKV decode speed of a built-in real model on the CPU: what sizes an accuracy run (how many
records and budgets a CPU run of that model can afford; docs/accuracy.md quotes the figures).

    python benchmarks/bench_real_model_speed.py qwen2.5-1.5b bf16 4096

Prints wall and CPU seconds (process time, all threads) of one dense prefill of N random tokens and the mean of 10
decode steps after 3 warm-up steps. State the load (`uptime`) with the figures: the machine is shared.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md); before torch

import torch  # noqa: E402

from scoutbench.decode.engine import DecodeEngine  # noqa: E402
from scoutbench.eval.generation import silent_timer  # noqa: E402
from scoutbench.methods.fullkv import FullKV  # noqa: E402
from scoutbench.models import load_model, parse_dtype  # noqa: E402

WARMUP_STEPS, TIMED_STEPS = 3, 10


@torch.no_grad()
def main() -> None:
    name, dtype, tokens = sys.argv[1], parse_dtype(sys.argv[2]), int(sys.argv[3])
    model = load_model(name, "cpu", dtype).model
    with DecodeEngine(model, FullKV(), silent_timer(torch.device("cpu"))) as engine:
        engine.start(1, tokens + WARMUP_STEPS + TIMED_STEPS + 1)
        wall, cpu = time.perf_counter(), time.process_time()
        token = engine.prefill(torch.randint(100, 20000, (1, tokens))).argmax(-1)
        print(f"{name} {dtype} prefill {tokens}: {time.perf_counter() - wall:.1f} s wall, "
              f"{time.process_time() - cpu:.1f} s cpu", flush=True)
        for _ in range(WARMUP_STEPS):
            token = engine.decode_step(token).argmax(-1)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(TIMED_STEPS):
            token = engine.decode_step(token).argmax(-1)
        print(f"  decode: {(time.perf_counter() - wall) / TIMED_STEPS * 1e3:.0f} ms/step wall, "
              f"{(time.process_time() - cpu) / TIMED_STEPS * 1e3:.0f} ms/step cpu", flush=True)


if __name__ == "__main__":
    main()
