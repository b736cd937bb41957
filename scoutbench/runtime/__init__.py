"""Where a method's KV lives and how it moves: ScoutAttention's block table and tiered block store. Built on the
compute kernels of `scoutbench.kernels`, below the methods (docs/architecture.md)."""
