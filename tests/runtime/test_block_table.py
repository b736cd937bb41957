"""ScoutAttention's block table (runtime/block_table.py): the split of a selection by residency and readiness, the
eviction order, and the kernel library's one-call split against the torch path."""

import pytest
import torch

from scoutbench.runtime.block_table import BlockTable


def test_block_table_split_victims_and_readiness():
    table = BlockTable(batch=1, num_kv_heads=1, num_slots=3, max_blocks=10, device="cpu")
    table.assign(torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([4, 7]))
    ids = torch.tensor([[[7, 2, 5]]])
    valid = torch.tensor([[[True, True, False]]])
    on_dev, pending, slot = table.locate(ids, valid)
    assert on_dev.tolist() == [[[True, False, False]]] and not pending.any()
    assert slot[0, 0, 0] == 1
    scores = torch.arange(10.0)[None, None, :]
    order, available = table.victims(ids, valid, scores)
    # free slot 2 first, then block 4 (not selected); slot 1 holds the selected block 7
    assert order[0, 0, :2].tolist() == [2, 0] and available.item() == 2

    class Pending:
        done = False

        def query(self):
            return self.done

    event = Pending()
    table.assign(torch.tensor([0]), torch.tensor([2]), torch.tensor([2]), event)
    on_dev, pending, _ = table.locate(ids, valid)
    assert on_dev.tolist() == [[[True, False, False]]] and pending.tolist() == [[[False, True, False]]]
    _, available = table.victims(ids, valid, scores)
    assert available.item() == 1  # the in-flight slot is not evictable
    table.poll()
    assert table.pending_copies == 1
    event.done = True
    table.poll()
    on_dev, pending, _ = table.locate(ids, valid)
    assert on_dev.tolist() == [[[True, True, False]]] and not pending.any()
    # evicting block 4 from slot 0 makes it host-only
    table.assign(torch.tensor([0]), torch.tensor([0]), torch.tensor([9]))
    assert table.block_slot[0, 0, 4] == -1 and table.block_slot[0, 0, 9] == 0
    assert table.resident_sets() == [[{7, 2, 9}]]


@pytest.mark.parametrize("seed", range(4))
def test_split_plan_on_every_backend_equals_the_split_by_hand(seed):
    """`split_plan` (one call of the CPU kernel library here) and its torch ops (`split_reference`, CUDA's path)
    both give the split by hand bit for bit: `locate`, the stable CPU-first order, the packed plan and the pool-use
    mask, on a table with resident, in-flight and host-only blocks, invalid selections and duplicate padding ids."""
    from scoutbench.kernels import cpu_attention
    from scoutbench.kernels.split_plan import split_plan, split_reference

    g = torch.Generator().manual_seed(seed)
    batch, heads, slots, max_blocks, k = 2, 3, 6, 40, 6
    table = BlockTable(batch=batch, num_kv_heads=heads, num_slots=slots, max_blocks=max_blocks, device="cpu")

    class InFlight:
        def query(self):
            return False

    for row in range(batch * heads):
        blocks = torch.randperm(max_blocks, generator=g)[:5]
        table.assign(torch.full((4,), row), torch.arange(4), blocks[:4])
        table.assign(torch.tensor([row]), torch.tensor([4]), blocks[4:5], InFlight())  # slot 4: copy in flight
    ids = torch.randint(0, max_blocks, (batch, heads, k), generator=g)
    ids[..., -1] = 0  # padding
    ids[..., 1] = table.slot_block[..., 0]  # resident and ready
    ids[..., 3] = table.slot_block[..., 4]  # resident, its copy in flight
    valid = torch.rand(batch, heads, k, generator=g) < 0.8
    valid[..., 1] = valid[..., 3] = True
    victims = torch.randint(0, slots, (batch, heads, k), generator=g)
    available = torch.randint(0, slots, (batch, heads), generator=g)
    if cpu_attention.library() is None:
        pytest.skip("the CPU kernel is not built here")
    on_dev, pending, slot = table.locate(ids, valid)
    on_cpu = valid & ~on_dev
    order = torch.argsort(on_cpu.to(torch.uint8), dim=-1, descending=True, stable=True)
    counts = [on_cpu.sum(-1), valid.sum(-1), available, (table.slot_block[..., :slots] >= 0).sum(-1)]
    data = torch.cat([ids.gather(-1, order), pending.gather(-1, order).long(), victims, torch.stack(counts, -1)], -1)
    pool_use = torch.zeros((batch, heads, slots + 1), dtype=torch.bool)
    pool_use.scatter_(-1, torch.where(on_dev, slot, slots), True)
    tables = (table.block_slot, table.slot_ready, table.slot_block)
    for got in (split_plan(ids, valid, victims, available, *tables),
                split_reference(ids, valid, victims, available, *tables)):
        assert torch.equal(got[0], data)
        assert torch.equal(got[1], pool_use[..., :slots])
    assert pending.any() and on_dev.any() and on_cpu.any()  # every case occurred
