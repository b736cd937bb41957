"""Attention methods (installed as `scoutbench.methods`). One file per method; this registry is lazy, so listing
names never imports a method's code. Add a method: docs/adding_a_method.md."""

from scoutbench.registry import Registry

METHODS = Registry("method")
METHODS.register("fullkv", "scoutbench.methods.fullkv:FullKV", "full")
METHODS.register("quest", "scoutbench.methods.quest:Quest")
METHODS.register("infinigen", "scoutbench.methods.infinigen:InfiniGen")
METHODS.register("hgca", "scoutbench.methods.hgca:HGCA")
METHODS.register("scout", "scoutbench.methods.scout:ScoutAttention", "scoutattention")
# ScoutAttention ablation variants (paper Figure 12): parallel co-attention, +PC, +PC+PR (= scout).
METHODS.register("scout-base", "scoutbench.methods.scout:ScoutAttention", preset={"pc": False, "pr": False})
METHODS.register("scout-pc", "scoutbench.methods.scout:ScoutAttention", preset={"pc": True, "pr": False})
METHODS.register("scout-pr", "scoutbench.methods.scout:ScoutAttention", preset={"pc": False, "pr": True})

# The distinct algorithms (tests and benchmarks iterate over these; `--method all` adds the ablation variants).
ALL_METHODS = ["fullkv", "quest", "infinigen", "hgca", "scout"]
