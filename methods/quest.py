"""Quest (ICML 2024): query-aware block-sparse decode attention with every token on the device.

It is ScoutAttention's accuracy reference: the same digests and the same selection, without offloading. We follow the
official kernel path (mit-han-lab/Quest, `quest/`): the budget counts the tail block, the top `budget // block_size - 1`
complete blocks by the digest upper bound of the true query are attended together with the tail block (the possibly
partial block holding the newest token), and a layer whose context fits in the budget runs dense. GQA (the official
kernel is MHA-only): by default one selection per KV head, the group's query heads aggregated by max, which keeps the
score an upper bound for every head of the group (ScoutAttention selects the same way); `per_query_head=True` is the
official code's own choice, one selection per query head among its KV head's blocks (each head reads its own
`budget` tokens, so a KV head's group reads up to G times as many). The page size is `block_size`; the official
code's setting (16-token pages, per-query-head selection) is the registered preset `quest-official`. Deviation from
the official HF evaluation path, on purpose: no 3-block floor and a forced tail, as in the kernels the paper times.

Everything but the selection (storage, digests, the step's plan, the dense layers, the attention over the selected
blocks and the tail, statistics, memory and work model) is the block-selection base, methods/selection.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from scoutbench.methods.selection import BlockSelection


@dataclass
class Quest(BlockSelection):
    """A sparse layer attends the top `budget // block_size - 1` complete blocks by their digests' upper bound on
    the query's score, and the tail block (fields: `budget`, `block_size`, `dense_layers` of the base)."""

    name = "quest"
    display_name = "Quest"
    per_query_head: bool = False  # one selection per query head (the official code) instead of per KV head

    # the settings its defaults are chosen over (docs/methods.md, "One rule for every method's defaults")
    settings_grid = {f"pages {block}, per {rows}": {"block_size": block, "per_query_head": rows == "query head"}
                     for block in (32, 16) for rows in ("KV head", "query head")}
    paper_setting = ("pages 16, per query head", "Quest's own code (mit-han-lab/Quest; `quest-official`)")

    def select_blocks(self, layer, q):
        self.digests.select(layer, q, self.candidates, self.per_query_head, out=self.top_out)
