"""scoutbench's flashinfer adapter (scoutbench/kernels/flashinfer_decode.py) on emulated CUDA against a stand-in of
flashinfer's documented `BatchDecodeWithPagedKVCacheWrapper` contract (tests/flashinfer_standin.py): the stand-in
refuses what the real one refuses, the adapter meets it from every call site of every method (bf16, head_dim 64,
GQA groups on both decode paths), without a host sync, planning once per step and call site."""

from __future__ import annotations

import math

import gpu_configs
import pytest
import torch
from emulated import emulated_model, flashinfer_standin, run_emulated, small_qwen3, teacher_tokens
from method_harness import ragged_prompt

from scoutbench.kernels import backends, flashinfer_decode
from scoutbench.kernels.attention import decode_attention, partial_attention
from scoutbench.methods import build_method
from scoutbench.testing.emulated_cuda import EMULATED_DEVICE, emulated_cuda

# emulated CUDA runs where no real CUDA device is (it refuses otherwise); tests/emulation/test_gpu.py covers a real one
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is present"),
              pytest.mark.usefixtures("one_intra_op_thread")]

BF16 = torch.bfloat16
STEPS = 24
LENGTHS = [120, 83]



def _cuda(*tensors):
    return [t.to(EMULATED_DEVICE) for t in tensors]


def _table(lengths, capacity, page_size):
    return flashinfer_decode.page_table(lengths, capacity, page_size)


# ---------------------------------------------------------------------------------------------- the stand-in itself
def test_standin_computes_attention_with_a_base2_lse():
    import flashinfer_standin as standin

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 64, generator=generator).to(BF16)
    k = torch.randn(3, 1, 40, 64, generator=generator).to(BF16)  # 3 requests of one KV head, capacity 40 (8-pages)
    v = torch.randn(3, 1, 40, 64, generator=generator).to(BF16)
    lengths = [40, 1, 17]
    with emulated_cuda():
        wrapper = standin.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8,
                                                                         device="cuda"), "HND")
        wrapper.plan(*_table(lengths, 40, 8), 4, 1, 64, 8, q_data_type=BF16, kv_data_type=BF16, sm_scale=0.1)
        qc, kc, vc = _cuda(q, k, v)
        out, lse2 = wrapper.run(qc, (flashinfer_decode.row_pages(kc, 8), flashinfer_decode.row_pages(vc, 8)), return_lse=True)
        out, lse2 = out.cpu(), lse2.cpu()
    reference = partial_attention(q.float(), k.float(), v.float(), 0.1, torch.tensor(lengths)[:, None])
    assert out.dtype == BF16 and lse2.dtype == torch.float32
    torch.testing.assert_close(lse2 * math.log(2.0), reference.lse, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.float(), reference.o, atol=1e-2, rtol=0)


@pytest.mark.parametrize("case,message", [
    ("fp32", "no decode kernel for dtype"),
    ("group 5 on the CUDA-core path", "Unsupported group_size: 5"),
    ("group 6 before 0.6.18", "Unsupported group_size: 6"),
    ("head_dim 96", "Unsupported head_dim: 96"),
    ("last_page_len 0", "last_page_len must lie"),
    ("int64 page table", "must be int32"),
    ("workspace not zeroed", "not zeroed before its first use"),
    ("q dtype differs from the plan", "does not match the q_data_type"),
    ("page size differs from the plan", "does not match the plan"),
])
def test_standin_refuses_what_flashinfer_refuses(case, message):
    import flashinfer_standin as standin

    group = {"group 5 on the CUDA-core path": 5, "group 6 before 0.6.18": 6}.get(case, 4)
    head_dim = 96 if case == "head_dim 96" else 64
    dtype = torch.float32 if case == "fp32" else BF16
    version = "0.6.17" if case == "group 6 before 0.6.18" else "0.7.4"
    with flashinfer_standin(version), emulated_cuda():
        workspace = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        if case == "workspace not zeroed":
            workspace.fill_(7)
        wrapper = standin.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
        indptr, indices, last = _table([20, 7], 32, 16)
        if case == "last_page_len 0":
            last = last - last
        if case == "int64 page table":
            indptr = indptr.long()
        with pytest.raises((RuntimeError, ValueError), match=message):
            wrapper.plan(indptr, indices, last, group, 1, head_dim, 16, q_data_type=dtype, kv_data_type=dtype)
            q = torch.randn(2, group, head_dim, device="cuda").to(torch.float16 if "q dtype" in case else dtype)
            pages = torch.zeros(4, 1, 8 if "page size" in case else 16, head_dim, device="cuda").to(dtype)
            wrapper.run(q, (pages, pages), return_lse=True)


# ---------------------------------------------------------------------------------------------- the adapter
def _attention_inputs(group: int, num_keys: int = 300, seed: int = 0):
    return gpu_configs.attention_inputs(BF16, group, 64, num_keys, seed)


@pytest.mark.parametrize("version,group,expected", [
    ("0.7.4", 4, "flashinfer"), ("0.7.4", 5, "flashinfer-tc"), ("0.7.4", 6, "flashinfer"),
    ("0.7.4", 16, "flashinfer"), ("0.6.18", 16, "flashinfer-tc"), ("0.6.17", 6, "flashinfer-tc"),
])
def test_adapter_follows_the_decode_group_sizes_of_the_installed_release(version, group, expected):
    """2j: the CUDA-core decode kernel dispatches groups 1, 2, 3, 4, 8 (to 0.6.17), + 6 (0.6.18), + 16 (0.7.1):
    the adapter asks the installed release, uses that path where it is compiled, the tensor-core one elsewhere,
    and the result equals the torch reference (natural-log LSE, empty rows empty)."""
    q, k, v, valid = _attention_inputs(group)
    reference = partial_attention(q.float(), k.float(), v.float(), 0.125, valid)
    with flashinfer_standin(version), emulated_cuda() as runtime:
        backends.USAGE.reset()
        args = (*_cuda(q, k, v), 0.125, valid.to(EMULATED_DEVICE))
        with runtime.detect_syncs() as syncs:  # pinned page table, empty rows masked on the device
            got = partial_attention(*args, valid.reshape(-1).tolist())
        assert not syncs, syncs
        assert backends.USAGE.snapshot() == {f"cuda:{expected}": 1}
        o, lse = got.o.cpu(), got.lse.cpu()
    torch.testing.assert_close(lse, reference.lse, atol=2e-2, rtol=0)
    torch.testing.assert_close(o, reference.o, atol=2e-2, rtol=0)


def test_adapter_workspace_is_zeroed_before_first_use():
    """2b: flashinfer's float workspace 'must be initialized to 0 for its first use'; device memory from
    `torch.empty` holds whatever was there (the emulator fills it with garbage, as reused memory looks)."""
    q, k, v, valid = _attention_inputs(4)
    with flashinfer_standin(), emulated_cuda():
        decode_attention(*_cuda(q, k, v), 0.125, valid.to(EMULATED_DEVICE), valid.reshape(-1).tolist())


@pytest.mark.parametrize("name,max_len", [("fullkv", 65555), ("infinigen", 2100)])
def test_adapter_pages_are_whole_16_token_pages(name, max_len):
    """2c: rows whose capacity is not a multiple of 16 got pages of gcd(capacity, 16) tokens: 1 for FullKV at the
    CLI's default length (64k + 3 warm-up + 16 steps = 65555 tokens) and for InfiniGen's 2047-token fetch; the
    caches are rounded up to whole 16-token pages instead."""
    import flashinfer_standin as standin

    model = small_qwen3(num_heads=8, num_kv_heads=2, head_dim=64, dtype=BF16)
    method = build_method(name, {"budget": 2048, "dense_layers": 1} if name == "infinigen" else {})
    from scoutbench.decode.engine import DecodeEngine

    pages = []
    original = standin.BatchDecodeWithPagedKVCacheWrapper.plan

    def plan(self, *args, **kwargs):
        pages.append(args[6])
        return original(self, *args, **kwargs)

    standin.BatchDecodeWithPagedKVCacheWrapper.plan = plan
    try:
        with flashinfer_standin(), emulated_cuda():
            engine = DecodeEngine(emulated_model(model), method)
            engine.start(1, max_len)
            engine.prefill_synthetic(torch.tensor([max_len - 2]))
            engine.decode_step(torch.zeros(1, dtype=torch.long, device="cuda"))
            method.close()
    finally:
        standin.BatchDecodeWithPagedKVCacheWrapper.plan = original
    assert pages and set(pages) == {16}, pages


# ---------------------------------------------------------------------------------------------- every method
@pytest.fixture(scope="module")
def bf16_models():
    """bf16, head_dim 64 (flashinfer's kernels): a group of 4 (CUDA-core decode) and of 5 (tensor-core decode)."""
    return {group: small_qwen3(num_heads=2 * group, num_kv_heads=2, head_dim=64, dtype=BF16) for group in (4, 5)}


# every method and ablation on the CUDA-core path (group 4); each method once on the tensor-core path (group 5)
FLASHINFER_CASES = [(name, 4) for name in gpu_configs.ALL_NAMES] + \
    [(name, 5) for name in ("fullkv", "quest", "infinigen", "hgca", "scout")]


@pytest.mark.parametrize("name,group", FLASHINFER_CASES)
def test_every_method_meets_the_flashinfer_contract(bf16_models, name, group, monkeypatch):
    """Every method and ablation decodes through the adapter and the stand-in: each flashinfer call equals the
    torch backend on the same inputs, the decode loop has no host sync (page tables from pinned memory, empty rows
    masked on the device), and each call site plans once per step (the layers of a step share a plan)."""

    model = bf16_models[group]
    prompt, lengths = ragged_prompt(model.config.vocab_size, LENGTHS, seed=3)
    calls = []
    original = flashinfer_decode.flashinfer_partial

    def checked(q, k, v, scale, valid_len, lengths_host, use_tensor_cores):
        got = original(q, k, v, scale, valid_len, lengths_host, use_tensor_cores)
        ref = partial_attention(q.float(), k.float(), v.float(), scale, valid_len)  # fp32 torch backend
        calls.append((got.o.float() - ref.o).abs().max())  # device tensors: read after the run (no sync here)
        finite = torch.isfinite(ref.lse)
        calls.append(torch.where(finite, got.lse - ref.lse, 0.0).abs().max())
        return got

    monkeypatch.setattr(flashinfer_decode, "flashinfer_partial", checked)
    make = lambda: build_method(name, gpu_configs.method_args(name))  # noqa: E731
    reference = teacher_tokens(model, make(), prompt, lengths, STEPS)
    with flashinfer_standin() as fi:
        run = run_emulated(model, make, prompt, lengths, STEPS, reference=reference)
        plans = fi.BatchDecodeWithPagedKVCacheWrapper.plans
    flashinfer_calls = sum(n for key, n in run.backends.items() if "flashinfer" in key)
    with emulated_cuda():
        errors = [float(error) for error in calls]
    assert flashinfer_calls > 0 and errors and max(errors) < 3e-2, (run.backends, max(errors, default=None))
    assert not run.unexpected_syncs(), "\n".join(dict.fromkeys(map(str, run.unexpected_syncs())))
    # distinct call sites per step, by the method's family (a registered variant such as infinigen-dynamic has its
    # family's sites): InfiniGen's dense layers and its fetch target
    sites = {"fullkv": 1, "quest": 2, "infinigen": 2, "hgca": 2}.get(make().name, 1)
    assert plans <= (STEPS + 1) * sites + 2, plans
