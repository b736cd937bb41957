"""Generation as HF generate does it, the resumable accuracy runner, the CLI commands, fidelity, and every method
with a budget that covers the context giving FullKV's predictions on the real model."""

import json

import pytest
import torch
from cli_runner import run_cli
from repo_paths import TEST_DATA

from scoutbench.decode.engine import register_hf_attention
from scoutbench.errors import ScoutbenchError
from scoutbench.eval.accuracy import run_accuracy
from scoutbench.eval.generation import MethodSpec, generate_text, greedy_generate, method_spec, model_eos_ids
from scoutbench.methods import ALL_METHODS, METHODS
from scoutbench.methods.fullkv import FullKV
from scoutbench.workloads import longbench as lb
from scoutbench.workloads import longbench_metrics as m
from scoutbench.workloads.passkey import PasskeyTask

DATA = TEST_DATA / "longbench"




# ------------------------------------------------------------------------------------------ generation
@pytest.fixture()
def hf_with_engine_kernels(tiny_llama):
    """HF generate with the engine's attention kernels: same arithmetic, so tokens must match exactly."""
    previous = tiny_llama.config._attn_implementation
    tiny_llama.set_attn_implementation(register_hf_attention())
    yield tiny_llama
    tiny_llama.set_attn_implementation(previous)


def test_greedy_matches_hf_generate_with_stops_and_min_length(hf_with_engine_kernels):
    model = hf_with_engine_kernels
    prompt = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    free = greedy_generate(model, FullKV(), prompt[0].tolist(), 12)
    with torch.no_grad():
        reference = model.generate(prompt, max_new_tokens=12, do_sample=False, num_beams=1, eos_token_id=None,
                                   pad_token_id=0)[0, 40:].tolist()
    assert free == reference
    stop = free[4]
    expected = free[: free.index(stop) + 1]  # HF keeps the stop token in the output
    assert greedy_generate(model, FullKV(), prompt[0].tolist(), 12, frozenset({stop})) == expected
    # samsum's min_length = prompt + 1: the first token may not be a stop token
    forced = greedy_generate(model, FullKV(), prompt[0].tolist(), 12, frozenset({free[0], stop}), min_new_tokens=1)
    with torch.no_grad():
        reference = model.generate(prompt, max_new_tokens=12, do_sample=False, num_beams=1, min_length=41,
                                   eos_token_id=[free[0], stop], pad_token_id=0)[0, 40:].tolist()
    assert forced[0] != free[0] and forced == reference


def test_budget_maps_to_the_methods_own_field():
    assert method_spec("quest", budget=512).args == {"budget": 512}
    assert method_spec("infinigen", budget=512).args == {"budget": 512}
    assert method_spec("hgca", budget=512).args == {"budget": 512}
    with pytest.raises(ScoutbenchError, match="no selected method has a token budget"):
        method_spec("fullkv", budget=512)
    with pytest.raises(ScoutbenchError, match="--budget and --method-arg budget= both set budget"):
        method_spec("quest", {"budget": "64"}, budget=512)


# ------------------------------------------------------------------------------------------ runner and resume
def test_resume_never_keeps_a_row_predicted_from_another_prompt(smollm2, tmp_path, monkeypatch):
    """A rerun with other data under the same ids (another --data-dir or --data-revision) kept the rows of the first
    data: the folder and `_id` named the run and sample, not the text behind the id. Each row's prompt hash is
    checked against this run's prompt now, and a row from another prompt is exit 2 naming the file and line."""
    monkeypatch.setattr("scoutbench.eval.accuracy.generate_text", lambda *args, **kwargs: " answer")
    records = lb.load_records("2wikimqa", DATA)
    spec = MethodSpec("fullkv")
    task = lb.LongBenchTask("2wikimqa", records, smollm2.tokenizer, max_length=1500)
    run_accuracy([task], smollm2, spec, tmp_path, 1500, seed=0, limit=None)
    same = lb.LongBenchTask("2wikimqa", lb.load_records("2wikimqa", DATA), smollm2.tokenizer, max_length=1500)
    run_accuracy([same], smollm2, spec, tmp_path, 1500, seed=0, limit=None)  # the same prompts: resumed as done
    edited = [dict(record) for record in records]
    edited[1]["context"] = edited[1]["context"].replace("the", "a", 1) + " An edit."
    other = lb.LongBenchTask("2wikimqa", edited, smollm2.tokenizer, max_length=1500)
    with pytest.raises(ScoutbenchError, match=r"2wikimqa.jsonl line 2: sample 1 \(_id .*\) was predicted from another "
                                              r"prompt than this run's") as refused:
        run_accuracy([other], smollm2, spec, tmp_path, 1500, seed=0, limit=None)
    assert refused.value.exit_code == 2


def test_resume_after_interruption_never_duplicates(smollm2, tmp_path, monkeypatch):
    task = lb.LongBenchTask("2wikimqa", lb.load_records("2wikimqa", DATA), smollm2.tokenizer, max_length=1500)
    generated = []

    def fake_generate(model, tokenizer, spec, prompt_ids, max_new_tokens, stop_ids, min_new_tokens):
        """Stands in for the model (the runner's file handling is under test); deterministic per prompt."""
        generated.append(len(prompt_ids))
        assert max_new_tokens == 32 and min_new_tokens == 0
        return f" answer {len(prompt_ids)}"

    def interrupt_after_two(name, done, total):
        if done == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("scoutbench.eval.accuracy.generate_text", fake_generate)
    spec = MethodSpec("fullkv")
    with pytest.raises(KeyboardInterrupt):
        run_accuracy([task], smollm2, spec, tmp_path, 1500, seed=0, limit=None, on_progress=interrupt_after_two)
    (path,) = tmp_path.glob("smollm2-135m/fullkv-*/2wikimqa.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == 2  # both finished samples were flushed; nothing was in flight
    with open(path, "a") as handle:
        handle.write(lines[1][:25])  # as if killed in the middle of writing the third line

    generated.clear()
    result, result_path = run_accuracy([task], smollm2, spec, tmp_path, 1500, seed=0, limit=None)
    assert len(generated) == 1  # only the missing sample
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["index"] for row in rows] == [0, 1, 2]
    assert [row["_id"] for row in rows] == [record["_id"] for record in task.records]
    assert [json.dumps(row, ensure_ascii=False) for row in rows[:2]] == lines
    assert rows[2]["pred"] == f" answer {rows[2]['input_tokens']}"
    assert set(rows[0]) >= {"pred", "answers", "all_classes", "length"}
    assert result["results"]["2wikimqa"]["score"] == m.dataset_score("2wikimqa", rows)
    assert result["results"]["2wikimqa"]["n"] == 3 and result["results"]["2wikimqa"]["max_length"] == 1500
    saved = json.loads(result_path.read_text())
    assert saved["method_repr"] == "FullKV()" and saved["model"]["name"] == "smollm2-135m"
    assert saved["max_length"] == 1500 and saved["env"]["scoring"]["rouge"] == "1.0.1"

    generated.clear()
    again, _ = run_accuracy([task], smollm2, spec, tmp_path, 1500, seed=0, limit=None)
    assert generated == [] and path.read_text().count("\n") == 3 and again["results"] == result["results"]
    two, _ = run_accuracy([lb.LongBenchTask("2wikimqa", task.records[:2], smollm2.tokenizer, 1500)], smollm2, spec,
                          tmp_path, 1500, seed=0, limit=2)
    assert generated == [] and two["results"]["2wikimqa"]["n"] == 2  # a smaller --limit scores the first rows


def test_predictions_of_other_data_are_not_mixed_in(smollm2, tmp_path, monkeypatch):
    monkeypatch.setattr("scoutbench.eval.accuracy.generate_text", lambda *args, **kwargs: " Paris")
    records = lb.load_records("2wikimqa", DATA)
    task = lb.LongBenchTask("2wikimqa", records, smollm2.tokenizer, max_length=1500)
    run_accuracy([task], smollm2, MethodSpec("fullkv"), tmp_path, 1500, seed=0, limit=None)
    shuffled = lb.LongBenchTask("2wikimqa", records[::-1], smollm2.tokenizer, max_length=1500)
    with pytest.raises(ScoutbenchError, match="line 1: expected sample 0"):
        run_accuracy([shuffled], smollm2, MethodSpec("fullkv"), tmp_path, 1500, seed=0, limit=None)


# ------------------------------------------------------------------------------------------ CLI
def test_malformed_data_is_an_error_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    """Bad input: exit 2 (docs/exit_codes.md), as every other fault of a LongBench data file."""
    out_dir = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "qasper", "--data-dir",
                           str(DATA.parent / "longbench_malformed"), "-o", str(out_dir))
    assert code == 2 and err.count("\n") == 1
    assert "longbench_malformed/qasper.jsonl line 2" in err
    assert not out_dir.exists()


def test_offline_without_data_dir_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    code, _, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "samsum", "-o", str(tmp_path / "out"))
    assert code == 1 and err.count("\n") == 1 and "--data-dir" in err
    assert not (tmp_path / "out").exists()


def test_budget_on_a_method_without_one_is_a_usage_error(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "passkey", "--method", "fullkv",
                           "--budget", "256")
    assert code == 2 and "no selected method has a token budget" in err


def test_accuracy_command_on_passkey(smollm2, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("scoutbench.models.load_model", lambda *args, **kwargs: smollm2)  # skip a second load
    code, out, _ = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "passkey", "--len", "256", "--limit", "1",
                           "--device", "cpu", "-o", str(tmp_path), "--json")
    result = json.loads(out)
    assert code == 0 and result["results"]["passkey_256"]["n"] == 1
    assert result["results"]["passkey_256"]["score"] == 100.0 and result["command"][1] == "accuracy"
    # a larger --limit extends the run: the first sample is kept, only the new ones are generated
    generated = []
    real_generate = generate_text

    def counting_generate(*args, **kwargs):
        generated.append(1)
        return real_generate(*args, **kwargs)

    monkeypatch.setattr("scoutbench.eval.accuracy.generate_text", counting_generate)
    code, out, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "passkey", "--len", "256", "--limit", "3",
                             "--device", "cpu", "-o", str(tmp_path), "--json")
    assert code == 0, err
    assert json.loads(out)["results"]["passkey_256"]["n"] == 3 and len(generated) == 2


def _never(*args, **kwargs):
    raise AssertionError("the model must not load before every option is checked")


@pytest.mark.parametrize("args,message", [
    (["--dataset", "qasprr"], "did you mean 'qasper'?"),
    (["--dataset", "passkey", "--method", "scout", "--budget", "2q"], "bad --budget '2q'"),
    (["--dataset", "passkey", "--len", "1q"], "bad --len '1q'"),
    (["--dataset", "passkey", "--max-length", "lots"], "bad --max-length 'lots'"),
    (["--dataset", "passkey", "--depth", "1.5"], "--depth must be between 0 and 1"),
    (["--dataset", "passkey", "--limit", "0"], "--limit must be at least 1"),
    (["--dataset", "passkey", "--seed", str(2**64)], "'--seed'"),
    (["--dataset", "passkey", "--dtype", "int3"], "unknown dtype"),
    (["--dataset", "passkey", "--model", "tiny-qwen3"], "random weights and no tokenizer"),
    (["--dataset", "passkey", "--method", "scuot"], "did you mean 'scout'?"),
    (["--dataset", "qasper", "--data-dir", "{empty}"], "qasper.jsonl: no records"),
])
def test_accuracy_checks_every_option_before_loading_the_model(tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "qasper.jsonl").write_text("", encoding="utf-8")
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    code, _, err = run_cli(monkeypatch, capsys, "accuracy", *[a.format(empty=tmp_path / "empty") for a in args],
                           "-o", str(tmp_path / "out"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content,message", [
    (b'{"pred": 5, "answers": ["a"], "_id": "x", "index": 0}\n', "pred must be a string"),
    (b'{"pred": "a", "answers": "a", "_id": "x", "index": 0}\n', "answers must be a list of strings"),
    (b'["not", "an", "object"]\n', "expected a JSON object"),
    (b'{"pred": "caf\xe9"}\n', "not UTF-8 text"),
])
def test_malformed_prediction_file_is_one_error_naming_it(tmp_path, content, message):
    from scoutbench.eval.predictions import read_predictions

    path = tmp_path / "qasper.jsonl"
    path.write_bytes(content)
    with pytest.raises(ScoutbenchError, match=message):
        read_predictions(path, [{"_id": "x"}])


# ------------------------------------------------------------------------------------------ fidelity
def test_fidelity_of_fullkv_against_itself_is_perfect(smollm2):
    from scoutbench.eval.fidelity import fidelity_prompts, measure_fidelity

    prompts = fidelity_prompts(smollm2, 200, num_prompts=1, seed=0)
    metrics = measure_fidelity(smollm2, MethodSpec("fullkv"), prompts, steps=2)
    assert metrics["overall"]["top1_agreement"] == 1.0 and metrics["overall"]["kl_mean"] == 0.0
    assert metrics["overall"]["hidden_cosine"] == pytest.approx(1.0) and len(metrics["per_step"]) == 2


def test_a_cached_prefill_is_reused_only_for_the_same_settings_and_prompt(tiny_qwen3, tmp_path, monkeypatch):
    """`SharedPrefill.cached` saves the prefill once; a rerun with the same settings and prompt decodes from the
    file (no prefill runs) exactly as from the fresh one, and other settings or another prompt run it again."""
    from scoutbench.decode.engine import DecodeEngine
    from scoutbench.eval.fidelity import fullkv_reference, step_agreement
    from scoutbench.eval.generation import SharedPrefill

    prompt = torch.randint(0, tiny_qwen3.config.vocab_size, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    path, settings = tmp_path / "prefill.pt", {"model": "tiny-qwen3", "dtype": "fp32"}
    fresh = SharedPrefill.cached(tiny_qwen3, prompt, path, settings)
    reference = fullkv_reference(fresh, 4)
    spec = MethodSpec("quest", {"budget": 32, "block_size": 8})
    expected = fresh.forced(spec, reference.token_ids[:4])
    assert expected.method_stats["attended_tokens_per_head"]["within_budget"] is True
    prefills = []
    original = DecodeEngine.prefill
    monkeypatch.setattr(DecodeEngine, "prefill", lambda *a, **k: prefills.append(1) or original(*a, **k))
    loaded = SharedPrefill.cached(tiny_qwen3, prompt, path, settings)
    assert not prefills and torch.equal(loaded.logits, fresh.logits)
    again = loaded.forced(spec, reference.token_ids[:4])
    assert torch.equal(again.log_probs, expected.log_probs)
    assert step_agreement(reference, again) == step_agreement(reference, expected)
    SharedPrefill.cached(tiny_qwen3, prompt, path, {**settings, "dtype": "bf16"})
    SharedPrefill.cached(tiny_qwen3, prompt[1:], path, {**settings, "dtype": "bf16"})
    assert len(prefills) == 2 and not list(tmp_path.glob("*.tmp"))


def test_fidelity_command_on_a_model_without_tokenizer(monkeypatch, capsys):
    """Random-weight presets get seeded random prompts; Quest covering the whole context matches FullKV."""
    code, out, _ = run_cli(monkeypatch, capsys, "fidelity", "--model", "tiny-llama", "--method", "quest",
                           "--budget", "4096", "--len", "150", "--steps", "3", "--prompts", "1", "--device", "cpu",
                           "--json")
    result = json.loads(out)
    assert code == 0 and result["kind"] == "fidelity" and result["prompt_tokens"] == [150]
    assert result["overall"]["top1_agreement"] == 1.0 and result["overall"]["kl_mean"] < 1e-6
    assert result["overall"]["hidden_cosine_min"] > 0.9999 and result["method_config"]["budget"] == 4096
    assert result["overall"]["top1_agreement_ci95"] == [1.0, 1.0]  # the interval over prompts (one here)
    code, out, _ = run_cli(monkeypatch, capsys, "fidelity", "--model", "tiny-llama", "--method", "quest",
                           "--budget", "4096", "--len", "150", "--steps", "3", "--prompts", "1", "--device", "cpu")
    assert code == 0 and "1.000 [1.000, 1.000]" in out and "95% interval over the 1 prompts" in out
    assert "settings: quest pages 32, per KV head (paper: pages 16, per query head)" in " ".join(out.split())


# ------------------------------------------------------------------------------------------ methods vs FullKV
# Settings under which each method attends every token (each method's FullKV-exactness case: Quest and Scout with a
# budget above the context, Scout in oracle mode, InfiniGen with alpha = inf and a fetch cap above the context,
# HGCA's fraction policy with the CPU attending all of its tokens).
COVERING_ARGS = {
    "quest": {"budget": "4096"},
    "infinigen": {"budget": "4096"},
    "hgca": {"budget": "none", "cpu_topk_frac": "1"},
    "scout": {"budget": "4096", "oracle": "true"},
}


def test_every_compared_method_is_covered():
    assert set(ALL_METHODS) == {"fullkv", *COVERING_ARGS}


@pytest.fixture(scope="module")
def fullkv_predictions(smollm2):
    """(prompt ids, FullKV's text) for a passkey prompt and a qasper prompt, 16 new tokens each."""
    tokenizer = smollm2.tokenizer
    passkey = PasskeyTask("passkey", tokenizer, 300, num_samples=1, depth=0.4)
    qasper = lb.LongBenchTask("qasper", lb.load_records("qasper", DATA)[:1], tokenizer, max_length=1500)
    prompts = [task.input_ids(task.records[0]) for task in (passkey, qasper)]
    stops = model_eos_ids(smollm2.model, tokenizer)
    return [(prompt, generate_text(smollm2.model, tokenizer, MethodSpec("fullkv"), prompt, 16, stops))
            for prompt in prompts]


@pytest.mark.parametrize("method", sorted(COVERING_ARGS))
def test_full_budget_predictions_equal_fullkv(smollm2, fullkv_predictions, method):
    METHODS.load(method)  # fails (not skips) if the registry points at a missing method
    stops = model_eos_ids(smollm2.model, smollm2.tokenizer)
    for prompt, expected in fullkv_predictions:
        got = generate_text(smollm2.model, smollm2.tokenizer, MethodSpec(method, COVERING_ARGS[method]), prompt,
                            16, stops)
        assert got == expected, f"{method}: {got!r} != FullKV's {expected!r}"


@pytest.mark.parametrize("content,message", [
    (b'{"pred": 5, "answers": ["a"]}\n', "line 1: pred must be a string"),
    (b'{"pred": "a", "answers": [1]}\n', "line 1: answers must be a list of strings"),
    (b'{"pred": "a", "answers": ["a"], "all_classes": true}\n', "line 1: all_classes must be null or a list"),
    (b'{"pred": "caf\xe9", "answers": ["a"]}\n', "not UTF-8 text"),
    (b'\n\n', "no predictions to score"),
])
def test_score_command_rejects_malformed_files_in_one_line(tmp_path, monkeypatch, capsys, content, message):
    path = tmp_path / "predictions.jsonl"
    path.write_bytes(content)
    code, _, err = run_cli(monkeypatch, capsys, "score", "--dataset", "qasper", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------------------ several methods
COMPARE_ARGS = ["--dataset", "2wikimqa", "--data-dir", str(DATA), "--limit", "1", "--method", "fullkv", "--method",
                "quest", "--method", "scout", "--budget", "64", "--method-arg", "block_size=16", "--max-length",
                "1500", "--device", "cpu"]


def test_method_specs_expand_methods_and_budgets():
    from scoutbench.eval.generation import method_specs

    specs = method_specs(["fullkv", "quest", "scout"], {"block_size": "16"}, [1024, 2048])
    assert [(s.name, s.args) for s in specs] == [
        ("fullkv", {}), ("quest", {"block_size": "16", "budget": 1024}), ("quest", {"block_size": "16", "budget": 2048}),
        ("scout", {"block_size": "16", "budget": 1024}), ("scout", {"block_size": "16", "budget": 2048})]
    with pytest.raises(ScoutbenchError, match=r"'block_size' is not a field of any selected method \(fullkv, hgca\)"):
        method_specs(["fullkv", "hgca"], {"block_size": "16"})
    with pytest.raises(ScoutbenchError, match="no selected method has a token budget"):
        method_specs(["fullkv"], budgets=[1024])


def test_several_methods_in_one_run_predict_what_separate_runs_predict(smollm2, tmp_path, monkeypatch, capsys):
    """`--method` repeated and a budget list give one configuration per (method, budget), FullKV
    once; they share one dense prefill per record and predict exactly what one run per configuration predicts.
    Each result compares with FullKV (agreement, teacher-forced fidelity) and the table puts them side by side."""
    monkeypatch.setattr("scoutbench.models.load_model", lambda *args, **kwargs: smollm2)
    table = tmp_path / "table.md"
    code, out, err = run_cli(monkeypatch, capsys, "accuracy", *COMPARE_ARGS, "--fidelity-steps", "4",
                             "-o", str(tmp_path / "together"), "--markdown", str(table), "--json")
    assert code == 0, err
    results = json.loads(out)
    labels = [r["label"] for r in results]
    assert labels == ["fullkv", "quest@64", "scout@64"]
    for result in results:
        for name in ("2wikimqa",):
            entry = result["results"][name]
            assert entry["n"] == 1 and entry["cpu_s_per_record"] >= 0
            if result["label"] == "fullkv":
                assert "vs_fullkv" not in entry and "fidelity" not in entry
                continue
            assert entry["dense_records"] == 0  # the budgets are below every prompt: really sparse
            vs = entry["vs_fullkv"]
            assert vs["n"] == entry["n"] and 0 <= vs["exact_match"] <= 100 and vs["score"] == entry["score"]
            fidelity = entry["fidelity"]
            assert fidelity["steps"] == 4 and fidelity["records"] == entry["n"]
            assert 0 < fidelity["compared_steps"] <= 4 * entry["n"] and fidelity["kl_mean"] >= 0

    for result in results[1:]:  # one run per configuration, each in its own output folder
        spec = MethodSpec(result["method"], result["method_config"])
        tasks = [lb.LongBenchTask("2wikimqa", lb.load_records("2wikimqa", DATA)[:1], smollm2.tokenizer, 1500)]
        alone, path = run_accuracy(tasks, smollm2, spec, tmp_path / "alone", 1500, seed=0, limit=1)
        folder = path.parent.relative_to(tmp_path / "alone")  # the same folder name: the hash has no -o in it
        for name in ("2wikimqa",):
            preds = [[json.loads(line)["pred"] for line in (tmp_path / run / folder / f"{name}.jsonl").open()]
                     for run in ("together", "alone")]
            assert preds[0] == preds[1], (result["label"], name)
            assert alone["results"][name]["score"] == result["results"][name]["score"]
    markdown = table.read_text()
    assert markdown.count("| task |") == 7 and "scout@64" in markdown and "change of the official score" in markdown
    assert "CPU seconds per record" in markdown
    # a rerun of the same command finds every configuration complete: nothing is generated again
    monkeypatch.setattr("scoutbench.eval.accuracy.SharedPrefill", _never)
    monkeypatch.setattr("scoutbench.eval.accuracy.generate_text", _never)
    code, out, err = run_cli(monkeypatch, capsys, "accuracy", *COMPARE_ARGS, "--fidelity-steps", "4",
                             "-o", str(tmp_path / "together"), "--json")
    assert code == 0, err
    assert [r["results"] for r in json.loads(out)] == [r["results"] for r in results]


def test_summarize_scores_a_run_in_progress_without_touching_it(smollm2, tmp_path, monkeypatch, capsys):
    """`--summarize` generates nothing and writes no result: it scores what a (possibly running) run has on disk,
    with n per task saying how far it got; a half-written last line is skipped, not cut off."""
    monkeypatch.setattr("scoutbench.models.load_model", lambda *args, **kwargs: smollm2)
    monkeypatch.setattr("scoutbench.eval.accuracy.generate_text", lambda *args, **kwargs: " Paris")
    args = ["accuracy", "--dataset", "2wikimqa", "--data-dir", str(DATA), "--method", "fullkv", "--max-length",
            "1500", "--device", "cpu", "-o", str(tmp_path)]
    code, _, err = run_cli(monkeypatch, capsys, *args, "--limit", "2")
    assert code == 0, err
    (path,) = tmp_path.glob("smollm2-135m/fullkv-*/2wikimqa.jsonl")
    with open(path, "a") as handle:
        handle.write('{"pred": "half')  # a line being written by the run
    before = {p: p.read_bytes() for p in path.parent.iterdir()}
    monkeypatch.setattr("scoutbench.eval.accuracy.generate_text", _never)
    code, out, err = run_cli(monkeypatch, capsys, *args, "--summarize", "--json")
    assert code == 0, err
    assert json.loads(out)["results"]["2wikimqa"]["n"] == 2  # of 3 records
    assert {p: p.read_bytes() for p in path.parent.iterdir()} == before


def test_agreement_scores_each_prediction_against_fullkvs_own(smollm2):
    """Exact match with FullKV's prediction, the task's metric with FullKV's prediction as the only reference
    (undefined records counted, not scored), and the official score's change relative to FullKV's."""
    from scoutbench.eval.accuracy import agreement_with_reference

    def rows(preds, answers):
        return [{"pred": p, "answers": [a], "all_classes": None, "length": 10, "_id": str(i), "index": i}
                for i, (p, a) in enumerate(zip(preds, answers, strict=True))]

    qa = lb.LongBenchTask("2wikimqa", [], None, max_length=100)
    answers = ["Paris", "blue whale", "1999"]
    fullkv = rows(["Paris", "the blue whale", "in 1998"], answers)
    method = rows(["Paris", "a whale", "in 1998"], answers)
    vs = agreement_with_reference(qa, method, fullkv)
    assert vs["n"] == 3 and vs["exact_match"] == pytest.approx(66.67)
    assert vs["metric_vs_fullkv_pred"] == pytest.approx(100 * (1 + m.qa_f1_score("a whale", "the blue whale") + 1) / 3,
                                                        abs=0.01)
    assert vs["score"] == m.dataset_score("2wikimqa", method) and vs["fullkv_score"] == m.dataset_score("2wikimqa", fullkv)
    assert vs["score_change_pct"] == pytest.approx(100 * (vs["score"] - vs["fullkv_score"]) / vs["fullkv_score"], abs=0.01)
    retrieval = lb.LongBenchTask("passage_retrieval_en", [], None, max_length=100)
    answers = ["Paragraph 3", "Paragraph 5"]
    vs = agreement_with_reference(retrieval, rows(["Paragraph 3", "Paragraph 2"], answers),
                                  rows(["Paragraph 3", "I do not know"], answers))
    assert vs["metric_vs_fullkv_pred"] == 100.0 and vs["metric_undefined"] == 1  # no paragraph in FullKV's answer
    passkey = PasskeyTask("passkey", smollm2.tokenizer, 256, num_samples=1)
    assert passkey.reference_answer("The pass key is 40612.") == "40612"
    vs = agreement_with_reference(passkey, rows(["The pass key is 40612!", "4."], ["40612", "40612"]),
                                  rows(["The pass key is 40612.", "40612"], ["40612", "40612"]))
    assert vs["exact_match"] == 0.0 and vs["metric_vs_fullkv_pred"] == 50.0
    assert agreement_with_reference(qa, method, []) is None


def test_comparison_tables_while_no_task_is_finished_by_every_configuration():
    """`accuracy --summarize` on a run in progress where no task is finished by every configuration: the mean row
    has nothing to average ("-"), not a ZeroDivisionError (it raised once the fidelity table was in)."""
    from scoutbench.eval.tables import comparison_tables
    from scoutbench.methods.fullkv import FullKV

    fidelity = {"steps": 32, "compared_steps": 10, "top1_agreement": 90.0, "kl_mean": 0.1,
                "samples": [{"index": 0, "steps": 10, "top1_agreement": 90.0, "kl_mean": 0.1}]}
    reference = {"method_repr": repr(FullKV()), "label": "fullkv",
                 "results": {"a": {"n": 2, "score": 50.0, "metric": "qa_f1"}}}
    scout = {"method_repr": "ScoutAttention()", "label": "scout@1024",
             "results": {"b": {"n": 1, "score": 40.0, "metric": "qa_f1", "fidelity": fidelity,
                               "vs_fullkv": {"exact_match": 100.0, "metric_vs_fullkv_pred": 100.0}}}}
    tables = {title: rows for title, _, rows in comparison_tables([reference, scout], ["a", "b"])}
    fidelity_rows = next(rows for title, rows in tables.items() if "top-1 agreement" in title)
    assert fidelity_rows[1] == ["b", "1", "90.0 [90.0, 90.0] †"] and fidelity_rows[-1][-1] == "-"
