"""Host launches per decode step of every method on the CUDA path, with CUDA graphs off and on: the torch calls the
main thread issues and the graph replays, counted on emulated CUDA (deterministic: the same on any machine), per
layer of the model they ran on. `scoutbench project` reads the committed table (scoutbench/data/launch_counts.json)
to add each method's host issue time to a projected step.

    python benchmarks/launch_counts.py            # rewrites scoutbench/data/launch_counts.json (a few minutes)

The configuration is issue 34's: bench-attn16 (16 layers, 2 dense), 2k context, budget 256, block 32, batch 1; the
calls are counted over 32 steps, a whole block cycle, so that each method's per-block work counts at its rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "scoutbench" / "data" / "launch_counts.json"
MODEL, LENGTH, BUDGET = "bench-attn16", "2k", "256"


def count(graphs: str, folder: Path) -> dict[str, dict[str, float]]:
    """Per method (registered names, ablations included): torch calls, replays, and both per layer."""
    env = {**os.environ, "SCOUTBENCH_EMULATE_CUDA": "1"}
    subprocess.run([sys.executable, "-m", "scoutbench", "throughput", "--model", MODEL, "--len", LENGTH, "--budget",
                    BUDGET, "--method", "all", "--steps", "2", "--warmup", "2", "--count-steps", "32",
                    "--cuda-graphs", graphs, "-o", str(folder), "--json"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    counts = {}
    for path in sorted(folder.glob("throughput_*.json")):
        result = json.loads(path.read_text())
        host, layers = result["host"], result["model"]["num_layers"]
        launches = host["torch_calls_per_step"] + (host.get("graph_replays_per_step") or 0)
        counts[result["method"]] = {"torch_calls_per_step": host["torch_calls_per_step"],
                                    "graph_replays_per_step": host.get("graph_replays_per_step"),
                                    "launches_per_layer": launches / layers,
                                    "captured": result["cuda_graphs"]["captured"]}
    return counts, layers


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        table = {"source": f"python benchmarks/launch_counts.py: emulated CUDA, {MODEL}, --len {LENGTH}, --budget "
                           f"{BUDGET}, batch 1, the main thread's torch calls and CUDA graph replays per decode step",
                 "model": MODEL}
        table["graphs_off"], table["layers"] = count("off", Path(tmp) / "off")
        table["graphs_on"], _ = count("on", Path(tmp) / "on")
    OUT.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    width = max(map(len, table["graphs_off"]))
    print(f"{'method':{width}} {'eager calls':>12} {'graphs: calls':>14} {'replays':>8} {'captured':>9}")
    for method, off in table["graphs_off"].items():
        on = table["graphs_on"][method]
        print(f"{method:{width}} {off['torch_calls_per_step']:12.0f} {on['torch_calls_per_step']:14.0f} "
              f"{on['graph_replays_per_step']:8.0f} {str(on['captured']):>9}")


if __name__ == "__main__":
    main()
