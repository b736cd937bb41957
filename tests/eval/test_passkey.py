"""Passkey retrieval: prompts sized with the real tokenizer, needles where asked, seeded, scored exactly; and the
real model finds the key with full attention."""

import pytest

from scoutbench.errors import UsageError
from scoutbench.eval.generation import greedy_generate, model_eos_ids
from scoutbench.methods.fullkv import FullKV
from scoutbench.workloads.passkey import FILLER, PasskeyTask, passkey_correct


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def test_prompt_fills_the_requested_length_without_exceeding_it(tokenizer):
    filler_tokens = len(tokenizer(FILLER).input_ids)
    for context_len in (256, 700):
        task = PasskeyTask("passkey", tokenizer, context_len, num_samples=2)
        for record in task.records:
            ids = task.input_ids(record)
            assert record["length"] == len(ids)
            assert context_len - filler_tokens <= len(ids) <= context_len  # one more filler sentence would not fit


def test_needle_sits_at_the_requested_depth(tokenizer):
    for depth in (0.0, 0.3, 1.0):
        record = PasskeyTask("passkey", tokenizer, 600, num_samples=1, depth=depth).records[0]
        context, key = record["context"], record["answers"][0]
        position = context.index(f"The pass key is {key}.") / len(context)
        assert abs(position - depth) < 0.06
    spread = PasskeyTask("passkey", tokenizer, 300, num_samples=7)
    assert sorted(r["depth"] for r in spread.records) == [0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875]


def test_a_larger_limit_extends_the_samples(tokenizer):
    """Sample i is the same prompt whatever the sample count: a rerun with a larger --limit resumes the run."""
    three = PasskeyTask("passkey", tokenizer, 256, num_samples=3).records
    five = PasskeyTask("passkey", tokenizer, 256, num_samples=5).records
    assert five[:3] == three
    assert [r["depth"] for r in five] == [0.5, 0.25, 0.75, 0.125, 0.625]


def test_records_are_seeded(tokenizer):
    first = PasskeyTask("passkey", tokenizer, 256, num_samples=3, seed=1).records
    again = PasskeyTask("passkey", tokenizer, 256, num_samples=3, seed=1).records
    other = PasskeyTask("passkey", tokenizer, 256, num_samples=3, seed=2).records
    assert first == again
    assert [r["answers"] for r in first] != [r["answers"] for r in other]
    assert len({r["_id"] for r in first}) == 3


def test_multi_key_asks_for_one_of_several_labelled_keys(tokenizer):
    task = PasskeyTask("passkey-multi", tokenizer, 500, num_samples=2, num_keys=4)
    for record in task.records:
        needles = [line for line in record["context"].split(". ") if line.startswith("The pass key for the")]
        assert len(needles) == 4
        label = record["input"].removeprefix("What is the pass key for the ").removesuffix(" door?")
        assert f"The pass key for the {label} door is {record['answers'][0]}" in record["context"]
        assert record["answer_prefix"] == f"The pass key for the {label} door is"
    assert task.name == "passkey-multi_500"


def test_exact_scoring(tokenizer):
    assert passkey_correct(" 40612. Remember it.", "40612")
    assert not passkey_correct(" 406123.", "40612")  # a longer number is not the key
    assert not passkey_correct(" 12345, or maybe 40612", "40612")  # only the first number counts
    assert not passkey_correct(" forty thousand", "40612")
    assert not passkey_correct("", "40612")
    task_rows = [{"pred": " 11111", "answers": ["11111"]}, {"pred": " 2", "answers": ["22222"]},
                 {"pred": "33333", "answers": ["33333"]}]
    assert PasskeyTask("passkey", tokenizer, 256, num_samples=1).score(task_rows) == {"score": 66.67}


def test_bad_arguments(tokenizer):
    with pytest.raises(UsageError, match="too short"):
        PasskeyTask("passkey", tokenizer, 40)
    with pytest.raises(UsageError, match="depth"):
        PasskeyTask("passkey", tokenizer, 256, depth=1.5)
    with pytest.raises(UsageError, match="tokenizer"):
        PasskeyTask("passkey", None, 256)


def test_fullkv_finds_the_key(smollm2):
    task = PasskeyTask("passkey", smollm2.tokenizer, 300, num_samples=2)
    stops = model_eos_ids(smollm2.model, smollm2.tokenizer)
    for record in task.records:
        new_ids = greedy_generate(smollm2.model, FullKV(), task.input_ids(record), task.max_new_tokens, stops)
        prediction = smollm2.tokenizer.decode(new_ids, skip_special_tokens=True)
        assert passkey_correct(prediction, record["answers"][0]), prediction


class _IdsTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_shared_prefill_predicts_what_separate_runs_predict(tiny_qwen2):
    """One dense prefill handed to every method (the accuracy grid) gives each method exactly the tokens of its own
    full run: methods only read the prefill's K/V."""
    import torch

    from scoutbench.eval.generation import generate_texts_shared_prefill, method_spec

    model = tiny_qwen2
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (400,)).tolist()
    specs = [method_spec("fullkv"), *(method_spec(name, budget=128) for name in ("quest", "infinigen", "hgca", "scout"))]
    shared = generate_texts_shared_prefill(model, _IdsTokenizer(), specs, prompt, 8, frozenset())
    for spec, text in zip(specs, shared, strict=True):
        alone = greedy_generate(model, spec.build(), prompt, 8)  # closes the method
        assert text == _IdsTokenizer().decode(alone), spec.name


@pytest.mark.slow
def test_qwen25_finds_the_key_at_1k(qwen25):
    task = PasskeyTask("passkey-multi", qwen25.tokenizer, 1024, num_samples=1)
    stops = model_eos_ids(qwen25.model, qwen25.tokenizer)
    record = task.records[0]
    new_ids = greedy_generate(qwen25.model, FullKV(), task.input_ids(record), task.max_new_tokens, stops)
    assert passkey_correct(qwen25.tokenizer.decode(new_ids, skip_special_tokens=True), record["answers"][0])
