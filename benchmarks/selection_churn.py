"""ScoutAttention's selection churn and CPU share on real text, by model and by reading of the paper's "blocks
changed per step" (issue 48 item 2).

The paper (section 3.2, Figure 6a) says that "on average less than 15% of important blocks change between
consecutive tokens" and (section 3.4) that the CPU attends 8.2% of the budget with per-layer recall. The real-text
sweep (benchmarks/real_text_sweep.py) measures a third of the selected blocks changing per step on qwen2.5-1.5b.
Whether that gap is the model's, the definition's or the method's is what this script measures: on the sweep's
records (the same prompts, prefills and FullKV tokens; `--dataset` picks as the sweep does), each ScoutAttention
configuration (block 32, a pool of 1 and 2 selections, periodic recall on and off) is teacher-forced on FullKV's
tokens once per model, and a recorder beside the method (`SelectionRecorder`, which only reads) keeps, per sparse
layer and step:

- the method's own split (its trace): the selected blocks per KV head (with the query predicted one layer ahead),
  those it read on the device and the pool's resident blocks;
- the top-k selection of the same step's candidates with the predicted query and with the true query, per KV head
  (the group's query heads max-aggregated, as the method selects) and per query head;
- the prefill's selection (the last prompt query, which seeds the pool), per KV head and per query head.

The readings are then computed offline (`readings`), per layer and per record, for every combination of
- the head: per KV head (what ScoutAttention selects and stores) or per query head (as Quest's own kernel does);
- the set: the whole selection, or only the changed blocks that land on the CPU (not resident in the pool);
- the reference: the previous step (consecutive tokens) or the prefill's selection;
- the query: predicted one layer ahead (what the method uses) or the true one,
each as the share of the k selected blocks, beside the CPU share itself (CPU-attended tokens over the budget).

    python benchmarks/selection_churn.py --model qwen2.5-0.5b --data-dir ../shared/longbench/records \\
        --dataset gov_report --dataset qmsum --dataset narrativeqa --dataset samsum -o results/real-text-sweep/churn
    python benchmarks/selection_churn.py --table results/real-text-sweep/churn

The recorded selections are kept in `--cache` (default `$SCOUTBENCH_CACHE/prefill`, beside the sweep's cached
prefills; about 10 MB per configuration and record) and a rerun only analyses them; `-o` receives one JSON per model
(`<model>.json`: every reading per configuration, mean over records and per record, per layer), written atomically.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scoutbench command (docs/platform.md); before torch

import torch  # noqa: E402
from real_text_sweep import Config, add_record_arguments, cached_reference, pick_records  # noqa: E402  (beside this script)

from scoutbench.cache import cache_root  # noqa: E402
from scoutbench.eval.fidelity import step_agreement  # noqa: E402
from scoutbench.eval.generation import SharedPrefill, method_spec  # noqa: E402
from scoutbench.models import load_model  # noqa: E402
from scoutbench.results import envelope, write_json_atomic  # noqa: E402
from scoutbench.units import format_length, parse_length  # noqa: E402

CONFIGS = [Config(f"scout-b32-pool{pool}x-{'pr' if recall else 'nopr'}", "scout",
                  {"block_size": 32, "pool_factor": pool, "pr": recall})
           for pool in (1, 2) for recall in (True, False)]
PAPER = {"churn": 0.15, "cpu_share": 0.082}  # section 3.2 ("less than 15%"), section 3.4 (8.2%)
HEADS, SETS, REFERENCES, QUERIES = ("kv", "q"), ("selected", "cpu"), ("consecutive", "prefill"), ("predicted", "true")


# ---------------------------------------------------------------------------------------------- recording
class SelectionRecorder:
    """Records what a ScoutAttention instance selects, beside it: its trace (the split it made) and the top-k of
    the same candidates for the predicted and the true query, per KV head and per query head. It wraps the
    method's contract hooks on the instance (`ingest_prefill`, `before_layer`, `decode`), calls the originals
    unchanged and only reads the method's digests, so the method computes exactly what it computes alone."""

    def __init__(self, method: Any) -> None:
        self.method = method
        method.trace = []
        self.prefill: dict[int, dict[str, torch.Tensor]] = {}
        self.steps: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (layer, step) -> selections
        ingest, before, decode = method.ingest_prefill, method.before_layer, method.decode

        def ingest_prefill(layer: int, q_obs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           lengths: torch.Tensor) -> None:
            ingest(layer, q_obs, k, v, lengths)
            if layer in method.sparse_layers:
                self.prefill[layer] = self._top(layer, q_obs[:, :, -1], lengths, int(lengths.max()))

        def before_layer(layer: int, hidden: torch.Tensor, normed: torch.Tensor) -> None:
            target = layer + 1
            if method.layer_ahead_active and target in method.sparse_layers:
                q_pred = method.ctx.predict_query(target, hidden, None if method.pred_norm == "next" else normed)
                self._record(target, "predicted", q_pred)
            before(layer, hidden, normed)

        def decode_layer(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if layer in method.sparse_layers:
                self._record(layer, "true", q)
            return decode(layer, q, k, v)

        method.ingest_prefill, method.before_layer, method.decode = ingest_prefill, before_layer, decode_layer

    def _top(self, layer: int, q: torch.Tensor, positions: torch.Tensor, max_position: int) -> dict[str, torch.Tensor]:
        """The top k_sel selectable blocks for `q` `[1, Hq, D]` with the new token at `positions`, per KV head and
        per query head (`[H, k]` int16, -1 past the valid ones)."""
        store, k = self.method.store, self.method.k_sel
        candidates, valid = store.selectable(positions, max_position, k)
        out = {}
        for head, per_query_head in (("kv", False), ("q", True)):
            ids, _ = store.digests.select(layer, q, candidates, per_query_head)
            ids = ids[0, :, :k].clone()
            ids[~valid[0, :1, :].expand_as(ids)] = -1
            out[head] = ids.to(torch.int16)
        return out

    def _record(self, layer: int, query: str, q: torch.Tensor) -> None:
        step = self.method.step
        top = self._top(layer, q, step.positions, max(step.positions_host) + 1)
        entry = self.steps.setdefault((layer, step.index), {})
        entry |= {f"{head}_{query}": ids for head, ids in top.items()}

    def tensors(self) -> dict[str, Any]:
        """Everything recorded, as int16 tensors `[sparse layers, steps, heads, width]` (-1 padding): the trace's
        selected, device and resident sets per KV head, the four recorded selections, and the prefill's."""
        method = self.method
        plans = {(r["layer"], r["step"]): r for r in method.trace if r["kind"] == "plan"}
        layers = sorted({layer for layer, _ in plans})
        steps = sorted({step for _, step in plans})

        def padded(sets: list[set[int]], width: int) -> torch.Tensor:
            out = torch.full((len(sets), width), -1, dtype=torch.int16)
            for row, blocks in enumerate(sets):
                out[row, : len(blocks)] = torch.tensor(sorted(blocks), dtype=torch.int16)
            return out

        def stack(rows: list[list[torch.Tensor]]) -> torch.Tensor:
            return torch.stack([torch.stack(row) for row in rows])

        trace = {name: stack([[padded(plans[(layer, step)][name][0], width) for step in steps] for layer in layers])
                 for name, width in (("selected", method.k_sel), ("device", method.k_sel),
                                     ("resident", method.pool_slots))}
        recorded = {name: stack([[self.steps[(layer, step)][name] for step in steps] for layer in layers])
                    for name in ("kv_predicted", "q_predicted", "kv_true", "q_true")}
        prefill = {f"prefill_{head}": torch.stack([self.prefill[layer][head] for layer in layers]) for head in HEADS}
        return {"layers": layers, "steps": steps, "k_sel": method.k_sel, "block_size": method.block_size,
                "budget": method.budget, "num_kv_heads": method.ctx.num_kv_heads, "num_heads": method.ctx.num_heads,
                **trace, **recorded, **prefill}


# ---------------------------------------------------------------------------------------------- readings
def masks(ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """int ids `[..., width]` (-1 padding) -> bool masks `[..., num_blocks]`."""
    out = torch.zeros((*ids.shape[:-1], num_blocks + 1), dtype=torch.bool)
    out.scatter_(-1, ids.long().where(ids >= 0, num_blocks), True)
    return out[..., :num_blocks]


def readings(recorded: dict[str, Any]) -> dict[str, Any]:
    """Every reading of one recorded run, per sparse layer (mean over steps and heads) and their mean over layers.

    For a selection S_t (per head row), the pool's resident set R_t of that row's KV head and a reference Ref_t
    (S_{t-1}, or the prefill's selection S_pre): `selected` = |S_t \\ Ref_t| / k, `cpu` = |(S_t \\ Ref_t) \\ R_t| / k
    (the changed blocks the CPU computes); consecutive readings from step 1. Also the CPU share as the method
    measures it (|S_t \\ D_t| * block_size / budget, D_t: the selected blocks read on the device), and the overlap
    of the predicted and the true query's selections (|S_pred ∩ S_true| / k)."""
    k, b, budget = recorded["k_sel"], recorded["block_size"], recorded["budget"]
    group = recorded["num_heads"] // recorded["num_kv_heads"]
    tensors = {name: value for name, value in recorded.items() if isinstance(value, torch.Tensor)}
    num_blocks = 1 + max(int(t.max()) for t in tensors.values())
    m = {name: masks(value, num_blocks) for name, value in tensors.items()}  # [L, T, H, nB]; prefill [L, H, nB]
    resident = {"kv": m["resident"], "q": m["resident"].repeat_interleave(group, dim=2)}
    out: dict[str, list[float]] = {}

    def share(mask: torch.Tensor) -> list[float]:  # [L, T', H, nB] -> per layer, mean over steps and heads / k
        return (mask.sum(-1).float().mean((1, 2)) / k).tolist()

    for head in HEADS:
        for query in QUERIES:
            selection = m[f"{head}_{query}"]
            for reference in REFERENCES:
                if reference == "consecutive":
                    new, pool = selection[:, 1:] & ~selection[:, :-1], resident[head][:, 1:]
                else:
                    new, pool = selection & ~m[f"prefill_{head}"][:, None], resident[head]
                out[f"{head}/selected/{reference}/{query}"] = share(new)
                out[f"{head}/cpu/{reference}/{query}"] = share(new & ~pool)
        out[f"{head}/overlap"] = share(m[f"{head}_predicted"] & m[f"{head}_true"])
    out["cpu_share"] = ((m["selected"] & ~m["device"]).sum(-1).float().mean((1, 2)) * b / budget).tolist()
    # the recorder's KV-head selection with the predicted query is the method's own: a check of the recording
    out["recorder_matches_method"] = [float(x) for x in (m["kv_predicted"] == m["selected"]).all(-1).float()
                                      .mean((1, 2))]
    return {"layers": recorded["layers"], "per_layer": out,
            "mean": {name: statistics.fmean(values) for name, values in out.items()}}


# ---------------------------------------------------------------------------------------------- running
def record_model(args: argparse.Namespace, cache: Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Record (or read back) every configuration on every record for `args.model`; returns the model's document
    and, per configuration, what each record's run recorded (settings and tensors)."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    loaded = load_model(args.model, "cpu", dtype)
    length = parse_length(args.length)
    records: dict[str, Any] = {}
    saved_runs: dict[str, list[dict[str, Any]]] = {}
    for dataset, index, record, _source, prompt in pick_records(args.data_dir, args.dataset, args.record,
                                                                loaded.tokenizer, length):
        steps = args.steps
        prompt_sha = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()
        settings = {"model": args.model, "dtype": args.dtype, "len": len(prompt), "budget": args.budget,
                    "dense_layers": args.dense_layers, "steps": steps, "record": f"{dataset}#{index}",
                    "record_id": record.get("_id"), "prompt_sha256": prompt_sha}
        stem = f"{args.model}-{args.dtype}-{dataset}-{index}-{format_length(len(prompt))}"
        shared = reference = None
        by_config = {}
        for config in CONFIGS:
            path = cache / "selections" / f"{stem}-{steps}-{config.label}.pt"
            saved = torch.load(path, weights_only=False) if path.exists() else None
            if saved is None or saved["settings"] != {**settings, "config": config.label}:
                if shared is None:
                    start = time.time()
                    shared = SharedPrefill.cached(loaded.model, prompt, cache / f"{stem}.prefill.pt",
                                                  {"model": args.model, "dtype": args.dtype})
                    reference = cached_reference(shared, steps, cache / f"{stem}.fullkv{steps}.pt", settings)
                    print(f"{settings['record']}: prefill and FullKV's tokens ready ({time.time() - start:.0f} s)",
                          flush=True)
                saved = _record(shared, reference, config, args, settings)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                torch.save(saved, tmp)
                os.replace(tmp, path)
            saved_runs.setdefault(config.label, []).append(saved)
            by_config[config.label] = {"readings": readings(saved["recorded"]), "top1_agreement": saved["top1"],
                                       "kl_mean": saved["kl"], "method_cpu_compute_ratio": saved["cpu_ratio"]}
            print(f"  {settings['record']} {config.label}: CPU share "
                  f"{by_config[config.label]['readings']['mean']['cpu_share']:.3f}", flush=True)
        records[settings["record"]] = by_config
    config = loaded.model.config
    return {**envelope("selection_churn", sys.argv), "model": args.model, "dtype": args.dtype,
            "shape": {"layers": config.num_hidden_layers, "heads": config.num_attention_heads,
                      "kv_heads": config.num_key_value_heads,
                      "head_dim": getattr(config, "head_dim", None)
                      or config.hidden_size // config.num_attention_heads},
            "len": length, "steps": args.steps, "budget": args.budget, "dense_layers": args.dense_layers,
            "paper": PAPER, "configs": {c.label: c.args for c in CONFIGS}, "records": records,
            "summary": summary(records)}, saved_runs


def _record(shared: SharedPrefill, reference: Any, config: Config, args: argparse.Namespace,
            settings: dict[str, Any]) -> dict[str, Any]:
    start = time.time()
    spec = method_spec(config.method, config.args, budget=args.budget, dense_layers=args.dense_layers)
    recorders: list[SelectionRecorder] = []
    ours = shared.forced(spec, reference.token_ids[: args.steps], lambda method: recorders.append(
        SelectionRecorder(method)))
    agreement = step_agreement(reference, ours)
    print(f"  {settings['record']} {config.label}: recorded ({time.time() - start:.0f} s)", flush=True)
    return {"settings": {**settings, "config": config.label}, "recorded": recorders[0].tensors(),
            "top1": statistics.fmean(agreement["top1"]), "kl": statistics.fmean(agreement["kl"]),
            "cpu_ratio": ours.method_stats["cpu_compute_ratio"]["mean"]}


def summary(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: every reading's mean over records (of the per-record mean over layers), its per-layer
    mean over records, and the readings' distance to the paper's numbers."""
    out = {}
    labels = next(iter(records.values())).keys()
    for label in labels:
        runs = [by_config[label] for by_config in records.values()]
        names = runs[0]["readings"]["mean"].keys()
        out[label] = {
            "records": len(runs),
            "mean": {name: statistics.fmean(r["readings"]["mean"][name] for r in runs) for name in names},
            "per_layer": {name: [statistics.fmean(values) for values in zip(
                *(r["readings"]["per_layer"][name] for r in runs), strict=True)] for name in names},
            "layers": runs[0]["readings"]["layers"],
            "top1_agreement": statistics.fmean(r["top1_agreement"] for r in runs),
            "kl_mean": statistics.fmean(r["kl_mean"] for r in runs)}
    return out


# ---------------------------------------------------------------------------------------------- recall profile
PROFILED = "scout-b32-pool2x-nopr"  # the profile's input: the selections of the default pool with recall off


def recall_profile(runs: list[dict[str, Any]], method: Any, args: argparse.Namespace, num_layers: int
                   ) -> dict[str, Any]:
    """A `scoutbench profile-recall` document from the recorded no-recall runs of `method` (a ScoutAttention with
    the runs' settings) on the records: the same procedure
    (`bench.recall.profile_intervals`: per layer, the drift after a recall into a pool of two selections, and the
    largest interval that keeps it under beta) on the same selections, which here were made teacher-forced on
    FullKV's greedy tokens from the sweep's cached prefills rather than on ScoutAttention's own greedy tokens after
    a prefill of its own (a 16k prefill of qwen2.5-1.5b is hours of this shared CPU)."""
    from scoutbench.bench.recall import profile_intervals

    traces = []
    for run in runs:
        recorded = run["recorded"]
        trace = []
        for li, layer in enumerate(recorded["layers"]):
            for ti, step in enumerate(recorded["steps"]):
                trace.append({"kind": "plan", "layer": layer, "step": step, **{
                    name: [[{int(j) for j in row if j >= 0} for row in recorded[name][li, ti]]]
                    for name in ("selected", "device")}})
        traces.append(trace)
    settings = [run["settings"] for run in runs]
    length, steps = settings[0]["len"], settings[0]["steps"]
    return {**envelope("scout_recall_profile", sys.argv), "model": args.model, "len": length, "steps": steps,
            "batch": 1, "beta": args.beta, "prefill": "real",
            "measured_on": {"prompts": "longbench", "dataset": ",".join(s["record"].split("#")[0] for s in settings),
                            "records": [{"dataset": s["record"].split("#")[0], "index": int(s["record"].split("#")[1]),
                                         "_id": s["record_id"], "tokens": s["len"]} for s in settings],
                            "decode": "teacher-forced on FullKV's greedy tokens (benchmarks/selection_churn.py)",
                            "model": args.model, "len": length, "steps": steps},
            "dtype": "bfloat16" if args.dtype == "bf16" else "float32", "device": "cpu", "method": method.config(),
            "k_sel": method.k_sel, "pool_slots": method.pool_slots, "budget": method.budget,
            **profile_intervals(traces, method, num_layers, args.beta), "interval_cap": max(1, steps - 1)}


# ---------------------------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Reading:
    head: str
    set: str
    reference: str
    query: str

    @property
    def key(self) -> str:
        return f"{self.head}/{self.set}/{self.reference}/{self.query}"

    @property
    def text(self) -> str:
        return (f"per {'KV' if self.head == 'kv' else 'query'} head, "
                f"{'selected set' if self.set == 'selected' else 'CPU part'}, "
                f"vs {'previous step' if self.reference == 'consecutive' else 'prefill'}, "
                f"{self.query} query")


READINGS = [Reading(h, s, r, q) for h in HEADS for s in SETS for r in REFERENCES for q in QUERIES]


def tables(documents: list[dict[str, Any]]) -> str:
    """Markdown: every reading per model for the default configuration's selection (the selected-set readings
    hardly depend on the pool) with the CPU-part readings per pool and recall; then the CPU share per
    configuration; then per layer for the method's own reading (per KV head, selected set, consecutive, predicted)."""
    models = [d["model"] for d in documents]
    labels = [c.label for c in CONFIGS]
    lines = ["| reading | " + " | ".join(f"{model} {label.removeprefix('scout-b32-')}" for model in models
                                        for label in labels) + " |",
             "|---" * (1 + len(models) * len(labels)) + "|"]
    for reading in READINGS:
        cells = [f"{d['summary'][label]['mean'][reading.key]:.3f}" for d in documents for label in labels]
        lines.append(f"| {reading.text} | " + " | ".join(cells) + " |")
    for name, text in (("cpu_share", "CPU share (CPU tokens / budget)"), ("kv/overlap", "predicted ∩ true, per KV head"),
                       ("q/overlap", "predicted ∩ true, per query head")):
        cells = [f"{d['summary'][label]['mean'][name]:.3f}" for d in documents for label in labels]
        lines.append(f"| {text} | " + " | ".join(cells) + " |")
    lines += ["", "Per layer (mean over records), default configuration (pool 2, recall): selected-set churn vs the "
              "previous step, per KV head / per query head (predicted query); CPU share", ""]
    for d in documents:
        s = d["summary"]["scout-b32-pool2x-pr"]
        lines.append(f"- {d['model']}: " + ", ".join(
            f"L{layer} {kv:.2f}/{q:.2f}/{cpu:.2f}" for layer, kv, q, cpu in zip(
                s["layers"], s["per_layer"]["kv/selected/consecutive/predicted"],
                s["per_layer"]["q/selected/consecutive/predicted"], s["per_layer"]["cpu_share"], strict=True)))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_record_arguments(parser)  # the real-text sweep's model and records
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=64, help="teacher-forced decode steps (default 64)")
    parser.add_argument("--cache", help="prefill and selection cache (default $SCOUTBENCH_CACHE/prefill)")
    parser.add_argument("-o", "--output", default="results/real-text-sweep/churn")
    parser.add_argument("--table", metavar="FOLDER", help="print the markdown tables of the models' JSONs, run nothing")
    parser.add_argument("--profile", metavar="JSON", help="also write the per-layer recall profile of the records "
                        f"(profile-recall's procedure on the {PROFILED} selections) to this file")
    parser.add_argument("--beta", type=float, default=0.12, help="the profile's CPU compute ratio threshold")
    args = parser.parse_args()
    if args.table:
        documents = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(Path(args.table).glob("*.json"))]
        print(tables(sorted(documents, key=lambda d: d["shape"]["layers"] * d["shape"]["heads"])))
        return
    if not (args.dataset or args.record) or not args.data_dir:
        sys.exit("give --data-dir and --dataset or --record")
    cache = Path(args.cache or cache_root() / "prefill")
    document, runs = record_model(args, cache)
    write_json_atomic(Path(args.output) / f"{args.model}.json", document, overwrite=True)
    if args.profile:
        from scoutbench.methods.scout import ScoutAttention

        config = next(c for c in CONFIGS if c.label == PROFILED)
        method = ScoutAttention.from_args({**config.args, "budget": args.budget, "dense_layers": args.dense_layers})
        profile = recall_profile(runs[PROFILED], method, args, document["shape"]["layers"])
        write_json_atomic(args.profile, profile, overwrite=True)
        print(f"{args.profile}: intervals {profile['intervals']} (mean {profile['mean_interval']:.1f}, expected "
              f"ratio {profile['expected_ratio_mean']:.3f})")


if __name__ == "__main__":
    main()
