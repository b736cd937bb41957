"""Config and listing: `sweep --config grid.(yaml|toml)` with the resolved config saved beside
the results, `scoutbench methods --json`, `accuracy --dataset list`."""

import dataclasses
import json

import yaml
from cli_runner import run_cli

TINY = {"model": "tiny-qwen3", "steps": 2, "warmup": 1, "device": "cpu"}


def test_sweep_config_yaml_flags_override_and_resolved_config_resumes(tmp_path, monkeypatch, capsys):
    config = tmp_path / "grid.yaml"
    config.write_text(yaml.safe_dump({"method": ["fullkv", "scout"], "len": ["256", "320"], "budget": 192, **TINY}))
    out = tmp_path / "out"
    code, stdout, err = run_cli(monkeypatch, capsys, "sweep", "--config", config, "--len", "256", "-o", out, "--json")
    assert code == 0, err
    manifest = json.loads(stdout)
    assert sorted((p["method"], p["len"]) for p in manifest["points"]) == [("fullkv", 256), ("scout", 256)]  # --len won
    assert manifest["settings"]["steps"] == 2 and manifest["settings"]["model"] == "tiny-qwen3"
    saved = yaml.safe_load((out / "sweep_config.yaml").read_text())
    assert saved["method"] == ["fullkv", "scout"] and saved["len"] == [256] and saved["budget"] == [192]
    assert saved["steps"] == 2 and saved["prefill"] == "synthetic" and saved["executor"] == "local"
    code, stdout, err = run_cli(monkeypatch, capsys, "sweep", "--config", out / "sweep_config.yaml", "-o", out, "--json")
    assert code == 0, err
    assert json.loads(stdout)["skipped"] == 2  # the saved config is the same sweep: it resumes, runs nothing


def test_sweep_config_toml_with_a_method_arg_mapping(tmp_path, monkeypatch, capsys):
    config = tmp_path / "grid.toml"
    config.write_text('method = "scout"\nlen = [256]\nbudget = [192]\nmodel = "tiny-qwen3"\nsteps = 2\nwarmup = 1\n'
                      'device = "cpu"\noutput = "%s"\n[method_arg]\nrecall_interval = [2, 4]\n' % (tmp_path / "o"))
    code, stdout, err = run_cli(monkeypatch, capsys, "sweep", "--config", config, "--json")  # -o from the file
    assert code == 0, err
    points = json.loads(stdout)["points"]
    assert sorted(p["method_args"]["recall_interval"] for p in points) == ["2", "4"]
    assert (tmp_path / "o" / "sweep_config.yaml").is_file()


def test_sweep_config_errors_are_one_line(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lenght: [4k]\n")
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--config", bad, "-o", tmp_path / "o")
    assert code == 2 and "unknown option 'lenght'; did you mean 'len'?" in err and err.count("\n") == 1
    broken = tmp_path / "broken.toml"
    broken.write_text("len = [\n")
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--config", broken, "-o", tmp_path / "o")
    assert code == 2 and err.startswith(f"error: --config {broken}:") and err.count("\n") == 1
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("steps: [2, 3]\n")
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--config", scalar, "-o", tmp_path / "o")
    assert code == 2 and "'steps' takes one value" in err


def test_methods_json_lists_every_method_with_fields_and_presets(monkeypatch, capsys):
    from scoutbench.methods import METHODS

    code, out, err = run_cli(monkeypatch, capsys, "methods", "--json")
    assert code == 0, err
    listing = {m["name"]: m for m in json.loads(out)}
    assert list(listing) == METHODS.names()
    for name, entry in listing.items():
        cls = METHODS.load(name)
        assert entry["class"] == f"{cls.__module__}:{cls.__qualname__}"
        assert set(entry["fields"]) == {f.name for f in dataclasses.fields(cls)}
        for key, value in METHODS.preset(name).items():  # an ablation preset's values are its defaults
            assert entry["fields"][key]["default"] == value and entry["preset"][key] == value
    assert listing["scout"]["fields"]["budget"] == {"default": 2048, "type": "int"}
    # its defaults' point on its grid, the paper-literal one beside it; none without a grid
    assert listing["scout"]["setting"] == "pool 3 (paper: pool 1)" and listing["fullkv"]["setting"] is None
    assert listing["quest-official"]["setting"] == "pages 16, per query head (the paper's)"


def test_methods_listing_aligns_its_columns_and_keeps_whole_sentences(monkeypatch, capsys):
    """`scoutbench methods` cut each summary at its docstring's first line (mid-sentence), pushed the longer names
    (infinigen-dynamic, quest-official) out of the column, and `--json`'s help said "one object per method" for a
    list."""
    from scoutbench.cli.env import first_sentence, methods_command
    from scoutbench.methods import METHODS

    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = run_cli(monkeypatch, capsys, "methods")
    assert code == 0, err
    lines = out.splitlines()
    column = max(map(len, METHODS.names())) + 2
    starts = [line for line in lines if not line.startswith(" ")]
    assert [line.split()[0] for line in starts] == METHODS.names()
    assert all(len(line) <= 100 and (line.startswith(" " * column) or line[column - 2:column] == "  "
                                     and line[column] != " ") for line in lines), out
    text = " ".join(out.split())
    for name in METHODS.names():
        summary = first_sentence(METHODS.load(name).__doc__)
        assert summary.endswith(".") and " ".join(summary.split()) in text, summary
    assert first_sentence("Keeps `a.b` (e.g. x. y) whole. Not this.") == "Keeps `a.b` (e.g. x. y) whole."
    help_text = next(option.help for option in methods_command.params if option.name == "as_json")
    assert "list" in help_text and isinstance(json.loads(run_cli(monkeypatch, capsys, "methods", "--json")[1]), list)


def test_accuracy_dataset_list(monkeypatch, capsys):
    from scoutbench.workloads.longbench_metrics import DATASETS, E_DATASETS

    code, out, err = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "list", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["name"] for r in rows] == [*DATASETS, *E_DATASETS, "passkey", "passkey-multi"]
    assert {r["name"]: r["metric"] for r in rows}["qasper"] == "qa_f1"
    code, out, _ = run_cli(monkeypatch, capsys, "accuracy", "--dataset", "list")
    assert code == 0 and out.splitlines()[0].split() == ["narrativeqa", "LongBench", "qa_f1"]


def test_shell_completion_offers_commands_and_the_dtype_choices():
    """What README's completion line relies on: click's completion protocol, answered without torch."""
    import os
    import subprocess
    import sys

    probe = ("import sys; from scoutbench.cli import main; sys.argv = ['scoutbench']; main()")

    def complete(words: str, cword: int) -> list[str]:
        env = {**os.environ, "_SCOUTBENCH_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
        proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        return [line.split(",", 1)[1] for line in proc.stdout.splitlines()]

    assert complete("scoutbench ex", 1) == ["export"]
    assert complete("scoutbench throughput --dtype ", 3) == ["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]
    assert "--profile" in complete("scoutbench throughput --pro", 2)


def test_dtype_choice_names_match_the_models_table():
    from scoutbench.cli.options import DTYPE_NAMES
    from scoutbench.models import DTYPES

    assert set(DTYPE_NAMES) == set(DTYPES)
