"""scoutbench's FullKV decode step vs stock transformers `model.generate` (attn_implementation="sdpa").

Same model, same context, greedy, CPU. Stock decode step = (time of generate(1 + S new tokens) - time of
generate(1 new token)) / S, i.e. prefill excluded. scoutbench's step = median timed step of `run_throughput`.
A ratio > 1 means scoutbench's FullKV decodes faster than stock transformers (on CPU, mostly because stock
`sdpa` uses `enable_gqa=True`, which torch's CPU kernels run 2-10x slower than the packed-GQA form).

    python benchmarks/bench_fullkv_vs_generate.py --model tiny-qwen3 --len 4k --steps 32
"""

from __future__ import annotations

import argparse
import time

import torch

from scoutbench.bench.throughput import ThroughputConfig, run_throughput
from scoutbench.models import load_model
from scoutbench.units import parse_length


def stock_step_ms(model, prompt: torch.Tensor, steps: int, repeats: int) -> float:
    def timed(new_tokens: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)
            best = min(best, time.perf_counter() - start)
        return best

    timed(2)  # warm-up
    return (timed(1 + steps) - timed(1)) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--len", default="4k")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    length = parse_length(args.len)
    loaded = load_model(args.model, "cpu", torch.float32, seed=0)
    model = loaded.model
    model.generation_config.eos_token_id = None
    prompt = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = stock_step_ms(model, prompt, args.steps, args.repeats)
    cfg = ThroughputConfig(method="fullkv", model=args.model, length=length, steps=args.steps, warmup=3,
                           device="cpu", command=["bench_fullkv_vs_generate"])
    ours = run_throughput(cfg, loaded)["decode_step_ms"]["median"]
    print(f"model={args.model} len={length} threads={torch.get_num_threads()} fp32 cpu")
    print(f"stock transformers generate (sdpa): {stock:8.2f} ms/step")
    print(f"scoutbench fullkv (median step):    {ours:8.2f} ms/step")
    print(f"ratio stock/scoutbench:             {stock / ours:8.2f}x")


if __name__ == "__main__":
    main()
