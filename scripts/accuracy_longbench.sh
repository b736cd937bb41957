#!/usr/bin/env bash
# The LongBench comparison of docs/accuracy.md: FullKV and every sparse method at budgets 1024 and 2048
# on the 82 real LongBench v1 records of ../shared/longbench/records, at their real lengths (--max-length: the
# model's default, 31500 tokens of its 32k window), qwen2.5-1.5b in bf16 on the CPU, greedy, with the
# teacher-forced fidelity over FullKV's first 32 generated tokens. Many hours of CPU time: resumable (rerun this
# script; finished records are skipped), each finished dataset is scored at once into results/accuracy/longbench/.
# The cheap datasets (32-token answers) come first, the 512-token summaries last. Every sparse method keeps the same
# 2 dense layers (`--method-arg dense_layers=2` reaches every method with that field; 2 is also every method's
# default now, HGCA's included, which once had 0), so the comparison is of the methods, not of how many layers each
# leaves dense.
#
#   setsid nohup nice -n 10 bash scripts/accuracy_longbench.sh > results/runs/accuracy-longbench.log 2>&1 &
#   bash scripts/accuracy_longbench.sh --summarize     # the tables of what has finished so far (generates nothing)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${DATA:-../shared/longbench/records}"
exec python -m scoutbench accuracy --model qwen2.5-1.5b --dtype bf16 --device cpu --data-dir "$DATA" \
    --dataset passage_retrieval_en --dataset 2wikimqa --dataset qasper --dataset samsum --dataset dureader \
    --dataset narrativeqa --dataset qmsum --dataset gov_report \
    --method fullkv --method quest --method infinigen --method hgca --method scout --budget 1024,2048 \
    --method-arg dense_layers=2 \
    --fidelity-steps 32 -o results/accuracy/longbench --markdown results/accuracy/longbench/table.md "$@"
