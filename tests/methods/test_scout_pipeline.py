"""ScoutAttention's layer-ahead pipeline (Algorithm 1) on tiny random models and SmolLM2: the predicted query, its
rotation, the order of submit / device part / wait, the synchronous first layer, the query-cosine tool, and a
covering budget on a real model."""

from __future__ import annotations

import threading

import pytest
import torch
from method_harness import assert_logits_close, fullkv_reference, ragged_prompt
from scout_harness import plans, scout_run, tokens_for
from scout_harness import prompt_300 as make_prompt_300

from scoutbench.methods.scout import ScoutAttention


@pytest.fixture(scope="module")
def prompt_300(tiny_qwen3):
    return make_prompt_300(tiny_qwen3)


# ---------------------------------------------------------------------------------------------- RoPE / prediction
@pytest.fixture(scope="module")
def identity_layers_model():
    """tiny-qwen3 whose layers 0..L-2 add nothing to the residual stream (o_proj and down_proj zeroed), so the
    layer-ahead prediction with pred_norm='next' is exactly the next layer's true query."""
    from scoutbench.models import load_model

    model = load_model("tiny-qwen3", "cpu", torch.float32, seed=0).model
    with torch.no_grad():
        for layer in model.model.layers[:-1]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def _record_outputs(method):
    outputs = []
    original = method.decode

    def decode(layer, q, k, v):
        out = original(layer, q, k, v)
        outputs.append((layer, out.clone()))
        return out

    method.decode = decode
    return outputs


def test_layer_ahead_prediction_exact_when_layers_are_identities(identity_layers_model):
    model = identity_layers_model
    prompt, lengths = ragged_prompt(model.config.vocab_size, [300], seed=4)
    tokens = tokens_for(model, prompt, lengths, 6)
    cfg = dict(budget=64, block_size=4, dense_layers=1)
    oracle = ScoutAttention(**cfg, oracle=True)
    predicted = ScoutAttention(**cfg, pc=True)
    out_oracle, out_pred = _record_outputs(oracle), _record_outputs(predicted)
    scout_run(model, oracle, prompt, lengths, tokens, trace=True)
    scout_run(model, predicted, prompt, lengths, tokens, trace=True)
    assert all(r["predicted"] for r in plans(predicted))
    assert [r["selected"] for r in plans(oracle)] == [r["selected"] for r in plans(predicted)]
    for (la, a), (lb, b) in zip(out_oracle, out_pred, strict=False):
        assert la == lb
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_unrotated_prediction_breaks_the_rope_sensitive_test(identity_layers_model, monkeypatch):
    """Mutation check: the predicted query is rotated at the current position, as the digests' keys are; without
    RoPE it selects other blocks and changes the outputs, so the exactness test above would fail."""
    from scoutbench.decode.engine import DecodeEngine

    model = identity_layers_model
    prompt, lengths = ragged_prompt(model.config.vocab_size, [300], seed=4)
    tokens = tokens_for(model, prompt, lengths, 6)
    cfg = dict(budget=64, block_size=4, dense_layers=1)
    oracle = ScoutAttention(**cfg, oracle=True)
    out_oracle = _record_outputs(oracle)
    scout_run(model, oracle, prompt, lengths, tokens, trace=True)

    def unrotated(self, target_layer, hidden, normed=None):
        layer = self.layers[target_layer]
        x = layer.input_layernorm(hidden) if normed is None else normed
        q = layer.self_attn.q_proj(x).view(x.shape[0], -1, self.head_dim)
        return layer.self_attn.q_norm(q)  # the mutation: no rotation at the current position

    monkeypatch.setattr(DecodeEngine, "predict_query", unrotated)
    mutant = ScoutAttention(**cfg, pc=True)
    out_mutant = _record_outputs(mutant)
    scout_run(model, mutant, prompt, lengths, tokens, trace=True)
    differing = sum(a["selected"] != b["selected"] for a, b in zip(plans(oracle), plans(mutant), strict=False))
    assert differing > 0
    assert any(not torch.allclose(a, b, atol=1e-5) for (_, a), (_, b) in zip(out_oracle, out_mutant, strict=False))


# ---------------------------------------------------------------------------------------------- the pipeline
def test_pc_submits_next_layer_before_the_device_part(tiny_qwen3, prompt_300):
    """Structural overlap check: with pc on, layer l+1's CPU task is submitted before layer l's device part
    runs, and it runs on a worker thread; with pc off it is submitted within layer l+1, before its device part."""
    prompt, lengths, tokens = prompt_300
    for pc in (True, False):
        method = ScoutAttention(budget=64, block_size=4, pc=pc)
        scout_run(tiny_qwen3, method, prompt, lengths, tokens[:3], trace=True)
        events = [(r["kind"], r["step"], r["layer"], r["thread"]) for r in method.trace
                  if r["kind"] in ("submit", "device", "wait", "cpu")]
        for step in range(3):
            order = [(kind, layer) for kind, s, layer, _ in events if s == step and kind != "cpu"]
            if pc:
                assert order.index(("submit", 3)) < order.index(("device", 2))
                assert order.index(("submit", 2)) < order.index(("device", 2))  # submitted during layer 1
            else:
                assert order.index(("submit", 3)) > order.index(("wait", 2))
                assert order.index(("submit", 3)) < order.index(("device", 3))
        main = threading.current_thread().name
        assert all(thread.startswith("scoutbench-cpu") and thread != main
                   for kind, _, _, thread in events if kind == "cpu")


def test_dense_layers_zero_runs_layer_zero_synchronously(tiny_qwen3, prompt_300):
    prompt, lengths, tokens = prompt_300
    method = ScoutAttention(budget=64, block_size=4, dense_layers=0)
    scout_run(tiny_qwen3, method, prompt, lengths, tokens[:2], trace=True)
    assert all(not r["predicted"] for r in plans(method, 0))
    assert all(r["predicted"] for layer in (1, 2, 3) for r in plans(method, layer))
    assert [r for r in method.trace if r["kind"] == "cpu" and r["layer"] == 0][0]["thread"] == \
        threading.current_thread().name


# ---------------------------------------------------------------------------------------------- real weights, cosine
def test_query_cosine(tiny_qwen3, identity_layers_model):
    from scoutbench.bench.cosine import query_cosine
    from scoutbench.models import LoadedModel

    result = query_cosine("tiny-qwen3", 64, 3, device="cpu", loaded=LoadedModel(tiny_qwen3, "tiny-qwen3", "preset", True))
    assert result["model"] == "tiny-qwen3" and len(result["per_layer"]) == 3
    assert all(-1.0 <= c <= 1.0 for c in result["per_layer"])
    exact = query_cosine("identity", 64, 3, device="cpu",
                         loaded=LoadedModel(identity_layers_model, "identity", "preset", True))
    assert exact["per_layer"] == pytest.approx([1.0, 1.0, 1.0], abs=1e-5)


def test_query_prediction_is_accurate_on_a_real_model(smollm2):
    """The premise of layer-ahead pre-computation on real weights (paper Table 1: 0.93-0.97): past the first two
    layers, Q_pred^{i+1} from layer i's input is within cosine 0.9 of the true query (SmolLM2-135M)."""
    from scoutbench.bench.cosine import query_cosine

    result = query_cosine("smollm2-135m", 256, 4, device="cpu", loaded=smollm2)
    assert len(result["per_layer"]) == 29
    assert min(result["per_layer"][2:]) >= 0.9, result["per_layer"]
    assert result["mean"] > 0.85


def _license_text_prompt(tokenizer, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`num_tokens` tokens of real English prose (CPython's LICENSE.txt, shipped with every Python install)."""
    import sysconfig
    from pathlib import Path

    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.is_file():
        pytest.skip(f"no {path} in this Python install")
    ids = tokenizer(path.read_text(encoding="utf-8"))["input_ids"][:num_tokens]
    assert len(ids) == num_tokens
    return torch.tensor([ids]), torch.tensor([num_tokens])


def test_budget_covering_the_context_equals_fullkv_on_a_real_model(smollm2):
    """With the default layer-ahead prediction and recall, a budget that covers the whole context leaves nothing
    to the CPU, so scout equals FullKV up to fp32 summation order. A block leaving the local window stays on the
    device; were it host-only, the CPU part would attend it with the *predicted* query (KL 1e-5 at each block
    boundary on SmolLM2). The decode crosses a block boundary at position 304."""
    model = smollm2.model
    prompt, lengths = _license_text_prompt(smollm2.tokenizer, 300)
    reference, tokens = fullkv_reference(model, prompt, lengths, 10)
    method = ScoutAttention(budget=512, block_size=16)
    ours = scout_run(model, method, prompt, lengths, tokens)
    assert method.stats()["cpu_compute_ratio"]["mean"] == 0.0
    for step, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert int(a.argmax()) == int(b.argmax()), f"step {step}"
        kl = (b.log_softmax(-1).exp() * (b.log_softmax(-1) - a.log_softmax(-1))).sum()
        assert abs(float(kl)) < 1e-6, f"step {step}: KL {float(kl):.3g}"
    assert_logits_close(ours, reference, atol=2e-3)


# ---------------------------------------------------------------------------------------------- Algorithm 1's shape
def test_algorithm_1_lines_3_to_12_fit_on_one_screen_with_the_papers_names():
    """Lines 3-12 of Algorithm 1 are `before_layer` (3-4), `_trigger` (5-7) and `decode_sparse` (8-12), adjacent,
    at most 40 lines together, and name the paper's quantities as variables (issue 50): a reader finds the step
    on one screen, and the backend and diagnostics are chosen outside it."""
    import ast
    import inspect

    import scoutbench.methods.scout as scout_module

    tree = ast.parse(inspect.getsource(scout_module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ScoutAttention")
    funcs = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    step = [funcs[name] for name in ("before_layer", "_trigger", "decode_sparse")]
    assert all(a.end_lineno + 2 == b.lineno for a, b in zip(step[:-1], step[1:], strict=True)), "adjacent"
    assert step[-1].end_lineno - step[0].lineno + 1 <= 40
    assigned = {n.id for f in step for n in ast.walk(f) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    assert {"Q_pred", "B_pred", "B_cpu", "B_gpu", "A_gpu", "A_cpu"} <= assigned
    switches = {n.attr for f in step for n in ast.walk(f) if isinstance(n, ast.Attribute)} & {
        "oracle", "pred_norm", "pc", "trace", "cuda", "device_blocks"}
    assert not switches, f"per-step switches in Algorithm 1: {switches}"


def test_tracing_records_without_changing_the_step(tiny_qwen3, prompt_300):
    """The trace is a hook at fixed points: a traced run decodes bit-identically to an untraced one, the untraced
    run records nothing, and the traced one records every plan, submit, device part and wait."""
    prompt, lengths, tokens = prompt_300
    kwargs = {"budget": 96, "block_size": 8, "recall_interval": 2}
    plain = ScoutAttention(**kwargs)
    untraced = scout_run(tiny_qwen3, plain, prompt, lengths, tokens)
    assert plain.trace is None
    traced_method = ScoutAttention(**kwargs)
    traced = scout_run(tiny_qwen3, traced_method, prompt, lengths, tokens, trace=True)
    assert all(torch.equal(a, b) for a, b in zip(untraced, traced, strict=True))
    kinds = {r["kind"] for r in traced_method.trace}
    assert {"plan", "submit", "cpu", "device", "wait", "recall"} <= kinds
