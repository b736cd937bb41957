"""The workload registry (`scoutbench.workloads.SUITES`): `accuracy --dataset X` resolves X through it, so a suite
registered in a test runs through `accuracy` without a change to the CLI."""

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from cli_runner import run_cli

from scoutbench.errors import UsageError
from scoutbench.workloads import SUITES, resolve_datasets, suite_for, suites
from scoutbench.workloads.suite import Suite, TaskSettings


@dataclass
class EchoTask:
    """Repeat a number: the answer is the record's number, scored by exact match of the prediction's first word."""

    dataset: str
    tokenizer: Any
    records: list[dict[str, Any]] = field(default_factory=list)
    max_new_tokens: int = 4
    min_new_tokens: int = 0

    @property
    def name(self) -> str:
        return self.dataset

    def stop_token_ids(self, model_eos_ids: frozenset[int]) -> frozenset[int]:
        return model_eos_ids

    def input_ids(self, record: dict[str, Any]) -> list[int]:
        return self.tokenizer.encode(record["input"])

    def describe(self) -> dict[str, Any]:
        return {"metric": "echo_exact", "max_new_tokens": self.max_new_tokens}

    def score(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise ValueError("no predictions")
        right = sum((row["pred"].split() or [""])[0] == row["answers"][0] for row in rows)
        return {"score": round(100 * right / len(rows), 2)}


class EchoSuite(Suite):
    usage = "echo-small, echo-large or 'echo'"

    def datasets(self) -> tuple[str, ...]:
        return ("echo-small", "echo-large")

    def groups(self) -> dict[str, tuple[tuple[str, ...], str]]:
        return {"echo": (self.datasets(), "both echo datasets")}

    def listing(self) -> list[dict[str, str]]:
        return [{"name": name, "suite": "echo", "metric": "echo_exact"} for name in self.datasets()]

    def task(self, dataset, tokenizer, records, source, settings: TaskSettings) -> EchoTask:
        count = settings.limit or 3
        base = 100 if dataset == "echo-large" else 1
        rows = [{"input": f"Repeat {base + i}:", "answers": [str(base + i)], "length": 2, "_id": f"{dataset}-{i}"}
                for i in range(count)]
        return EchoTask(dataset, tokenizer, rows)


def test_the_built_in_suites_answer_to_the_names_accuracy_accepts():
    from scoutbench.workloads import longbench, passkey

    assert SUITES.names() == ["longbench", "passkey"]
    assert suite_for("qasper") is longbench.SUITE and suite_for("lcc_e") is longbench.SUITE
    assert suite_for("passkey-multi") is passkey.SUITE
    assert resolve_datasets(["passkey", "all", "qasper"]) == ["passkey", *longbench.DATASETS]
    with pytest.raises(UsageError, match=r"unknown --dataset 'qasprr'; did you mean 'qasper'\? \(LongBench: "
                                         r"narrativeqa, .*, their _e variants, or 'all'; or passkey, passkey-multi\)$"):
        resolve_datasets(["qasprr"])


def test_a_suite_registered_in_a_test_resolves_and_lists():
    with SUITES.scoped():
        SUITES.register("echo", EchoSuite())
        assert resolve_datasets(["echo", "passkey", "echo-small"]) == ["echo-small", "echo-large", "passkey"]
        assert isinstance(suite_for("echo-large"), EchoSuite)
        with pytest.raises(UsageError, match=r"did you mean 'echo-small'\?.*; or echo-small, echo-large or 'echo'\)$"):
            resolve_datasets(["echo-smal"])
    assert "echo" not in SUITES and not any(isinstance(s, EchoSuite) for s in suites())


def test_a_toy_suite_runs_through_the_accuracy_command(smollm2, tmp_path, monkeypatch, capsys):
    """No CLI edit: the registered suite is listed, resolved, built, predicted, scored and written like passkey."""
    monkeypatch.setattr("scoutbench.models.load_model", lambda *args, **kwargs: smollm2)
    monkeypatch.setattr("scoutbench.eval.accuracy.generate_text",
                        lambda model, tokenizer, spec, prompt_ids, *args: " " + tokenizer.decode(prompt_ids).split()[-1]
                        .rstrip(":"))
    with SUITES.scoped():
        SUITES.register("echo", EchoSuite())
        code, out, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "list", "--json")
        assert code == 0, err
        assert [r["name"] for r in json.loads(out)][-2:] == ["echo-small", "echo-large"]
        code, out, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "list")
        assert out.splitlines()[-1].split() == ["echo", "both", "echo", "datasets"]
        code, out, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "echo", "--limit", "2", "--device",
                                 "cpu", "-o", str(tmp_path), "--json")
        assert code == 0, err
    result = json.loads(out)
    assert set(result["results"]) == {"echo-small", "echo-large"}
    for name in ("echo-small", "echo-large"):
        entry = result["results"][name]
        assert entry["n"] == 2 and entry["score"] == 100.0 and entry["metric"] == "echo_exact"
        (predictions,) = tmp_path.glob(f"smollm2-135m/fullkv-*/{name}.jsonl")
        assert len(predictions.read_text().splitlines()) == 2
    assert result["max_length"] is None  # the suite has no prompt limit of its own
