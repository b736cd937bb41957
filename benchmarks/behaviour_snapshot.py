"""A fingerprint of what every registered method computes, for a change that must not change it (a refactor):
each method on tiny-qwen3 in fp32 on the CPU, seed 0, a ragged batch of 2 (190 and 117 tokens), prefill and 6 greedy
decode steps through the public API; one line per method with the sha256 of its logits (every step) and of its
statistics' counters that are not timings. Run it before and after the change and compare the two outputs:

    python benchmarks/behaviour_snapshot.py > before.txt    # then, on the changed tree: > after.txt; diff
    SCOUTBENCH_CPU_ATTENTION=torch python benchmarks/behaviour_snapshot.py    # torch's CPU kernels
"""

import hashlib
import json
import sys

import torch

import scoutbench.methods
from scoutbench import api
from scoutbench.models import LoadedModel

# budgets well under the prompts, so that every sparse method selects, offloads and recalls in 6 steps
FIELDS = {"budget": 64, "block_size": 8, "dense_layers": 1}
PER_METHOD = {"fullkv": {}, "hgca": {"budget": 96, "dense_layers": 1, "migrate_block": 8},
              "scout": {"budget": 48, "block_size": 8, "dense_layers": 1, "recall_interval": 2},
              "infinigen": {"budget": 64, "dense_layers": 1}}
STEPS = 6


def run(name: str, loaded: LoadedModel) -> str:
    """One method's line: its settings, its logits' and its counters' digests."""
    kwargs = dict(PER_METHOD.get(name.split("-")[0], FIELDS))
    method = api.build_method(name, **kwargs)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    lengths = [190, 117]
    ids = torch.randint(0, loaded.model.config.vocab_size, (2, max(lengths)), generator=generator)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
    with api.decode_engine(loaded, method, batch=2, max_len=max(lengths) + STEPS + 1) as engine:
        logits = [engine.prefill(ids, torch.tensor(lengths))]
        for _ in range(STEPS):
            logits.append(engine.decode_step(logits[-1].argmax(-1)))
        stats = method.stats()
    digest = hashlib.sha256(torch.cat([x.float().reshape(-1) for x in logits]).numpy().tobytes()).hexdigest()[:16]
    counters = {k: v for k, v in sorted(stats.items()) if isinstance(v, (int, float)) and not isinstance(v, bool)
                and not any(t in k for t in ("_ms", "_s", "time", "per_s"))}
    counter_digest = hashlib.sha256(json.dumps(counters, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{name:18s} {kwargs} logits={digest} counters={counter_digest}"


def main() -> None:
    from scoutbench.methods import METHODS

    print("methods from", scoutbench.methods.__file__, file=sys.stderr)  # which tree's methods ran
    loaded = api.load_model("tiny-qwen3", device="cpu", dtype="float32", seed=0)
    for name in METHODS.names():
        print(run(name, loaded), flush=True)


if __name__ == "__main__":
    main()
