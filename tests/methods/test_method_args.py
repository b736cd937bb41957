"""One resolver for the method options of every command (scoutbench/method_args.py): a flag and a --method-arg
that set the same field are a usage error naming both, everywhere; a flag no selected method has a field for is
one too; --budget and --block-size take lengths (2k) in every command."""

from __future__ import annotations

import pytest
from cli_runner import run_cli

# imported before `load_model` is patched below: its module-level `from scoutbench.models import load_model`
# would otherwise keep the patch for every later test
import scoutbench.bench.throughput  # noqa: F401
from scoutbench.errors import UsageError
from scoutbench.method_args import BLOCK_SIZE, BUDGET, DENSE_LAYERS, MethodSettings, resolve_method_args

# every command that builds a method, with what it needs besides the method options (nothing is loaded: the
# options are resolved before any model)
COMMANDS = {
    "throughput": ["throughput", "--method", "scout", "--model", "tiny-qwen3", "--device", "cpu", "--len", "64"],
    "sweep": ["sweep", "--method", "scout", "--model", "tiny-qwen3", "--device", "cpu", "--len", "64", "-o", "out"],
    "plan": ["plan", "--method", "scout", "--model", "qwen3-8b", "--len", "32k", "--gpu-mem", "80GiB"],
    "accuracy": ["accuracy", "--dataset", "passkey", "--method", "scout", "--device", "cpu"],
    "fidelity": ["fidelity", "--method", "scout", "--model", "tiny-llama", "--device", "cpu"],
    "profile-recall": ["profile-recall", "--model", "tiny-qwen3", "--device", "cpu", "-o", "never.json"],
}
CONFLICTS = [(["--budget", "64", "--method-arg", "budget=32"], "--budget and --method-arg budget= both set budget"),
             (["--block-size", "16", "--method-arg", "block_size=8"],
              "--block-size and --method-arg block_size= both set block_size")]


def _never(*args, **kwargs):
    raise AssertionError("the model must not load before the method options are resolved")


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flags,message", CONFLICTS)
def test_a_flag_and_a_method_arg_for_one_field_conflict_in_every_command(command, flags, message, monkeypatch,
                                                                         capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    code, _, err = run_cli(monkeypatch, capsys, *COMMANDS[command], *flags)
    assert code == 2 and message in _one_line(err), (command, err)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in ("profile-recall",)])
def test_dense_layers_and_its_method_arg_conflict(command, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    code, _, err = run_cli(monkeypatch, capsys, *COMMANDS[command], "--dense-layers", "1",
                           "--method-arg", "dense_layers=0")
    assert code == 2 and "--dense-layers and --method-arg dense_layers= both set" in _one_line(err), (command, err)


@pytest.mark.parametrize("command", ["throughput", "sweep", "plan", "accuracy", "fidelity"])
def test_a_flag_no_selected_method_has_is_a_usage_error(command, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    args = [("fullkv" if a == "scout" else a) for a in COMMANDS[command]]
    code, _, err = run_cli(monkeypatch, capsys, *args, "--block-size", "16")
    assert code == 2 and "--block-size: no selected method has a block size (fullkv)" in _one_line(err), err


def test_every_budget_and_block_size_option_takes_a_length():
    from scoutbench.cli import cli
    from scoutbench.cli.options import LENGTH

    seen = []
    for name in cli.list_commands(None):
        for param in cli.get_command(None, name).params:
            if set(param.opts) & {"--budget", "--block-size"} and not param.multiple and name != "accuracy":
                assert param.type is LENGTH, (name, param.opts)
                seen.append((name, param.opts[0]))
    assert {"throughput", "plan", "fidelity", "profile-recall", "project"} <= {name for name, _ in seen}


def test_block_size_2k_is_accepted(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, *COMMANDS["plan"], "--block-size", "2k", "--budget", "8k", "--json")
    assert code == 0, err
    code, _, err = run_cli(monkeypatch, capsys, *COMMANDS["plan"], "--block-size", "2x")
    assert code == 2 and "bad --block-size '2x'" in _one_line(err)
    per_method = resolve_method_args(["scout"], MethodSettings.of(block_size=2048))
    assert per_method == {"scout": {"block_size": 2048}}


@pytest.mark.parametrize("command", ["throughput", "sweep", "accuracy", "fidelity"])
def test_block_size_takes_units_in_every_command(command, monkeypatch, capsys, tmp_path):
    """2k is read as 2048 (the method then refuses a block larger than its budget, or FullKV has no block size:
    either way not `bad --block-size`), 2x is a one-line `bad --block-size`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    args = [("fullkv" if a == "scout" else a) for a in COMMANDS[command]]
    code, _, err = run_cli(monkeypatch, capsys, *args, "--block-size", "2k")
    assert code == 2 and "--block-size: no selected method has a block size" in _one_line(err), err
    code, _, err = run_cli(monkeypatch, capsys, *args, "--block-size", "2x")
    assert code == 2 and "bad --block-size '2x'" in _one_line(err), err


def test_the_rules():
    methods = ["fullkv", "quest", "scout"]
    resolved = resolve_method_args(methods, MethodSettings.of({"recall_interval": "4"}, budget=512, dense_layers=1))
    assert resolved["fullkv"] == {}
    assert resolved["quest"] == {"budget": 512, "dense_layers": 1}
    assert resolved["scout"] == {"recall_interval": "4", "budget": 512, "dense_layers": 1}
    # a preset's size is a default: it yields to the user's --method-arg and is never an error
    preset = MethodSettings.of({"budget": "256"}, budget=1024, defaults=frozenset({BUDGET}))
    assert resolve_method_args(["scout"], preset) == {"scout": {"budget": "256"}}
    assert resolve_method_args(["fullkv"], MethodSettings.of(block_size=32, defaults=frozenset({BLOCK_SIZE}))) == {
        "fullkv": {}}
    with pytest.raises(UsageError, match="--dense-layers: no selected method keeps dense layers"):
        resolve_method_args(["fullkv"], MethodSettings.of(dense_layers=1))
    with pytest.raises(UsageError, match="'nope' is not a field of any selected method"):
        resolve_method_args(methods, MethodSettings.of({"nope": "1"}))


def test_the_dense_layers_flag_sets_the_methods_dense_layers_field():
    from scoutbench.methods.base import DENSE_LAYERS_FIELD

    assert DENSE_LAYERS.field == DENSE_LAYERS_FIELD


TINY_1K = ("--model", "tiny-qwen3", "--len", "1k", "--steps", "2", "--warmup", "0")


def test_block_size_without_a_method_that_has_one_is_refused_like_budget(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("scoutbench.models.load_model", _never)
    for command in (["throughput", *TINY_1K], ["sweep", "--len", "64"], ["plan", "--len", "1k", "--gpu-mem", "1GiB",
                                                                      "--model", "tiny-qwen3"]):
        output = [] if command[0] == "plan" else ["-o", str(tmp_path / command[0])]
        code, _, err = run_cli(monkeypatch, capsys, *command, "--method", "fullkv", "--method", "hgca",
                               "--block-size", "16", *output)
        assert code == 2 and "--block-size: no selected method has a block size" in err, (command, err)



@pytest.mark.parametrize(("name", "earlier", "later"), [
    ("hgca", {"score_read": "all"}, {"score_read": "selected"}),
    ("infinigen", {"count_cap": None, "count_cap_frac": None}, {"count_cap": 400, "count_cap_frac": 0.2}),
    ("scout", {"pool_factor": 1.0}, {"pool_factor": 3.0})])
def test_identity_leaves_out_a_field_added_later_only_at_its_earlier_behaviour(name: str, earlier: dict,
                                                                             later: dict) -> None:
    """An accuracy run's folder is named by `identity()`: a field added after runs were made is left out at the value
    that reproduces them (so those runs resume) and named at any other value (a new configuration)."""
    from methods import METHODS

    cls = METHODS.load(name)
    assert cls.added_fields == earlier
    before = cls(**earlier)
    shown = repr(before)
    for key, value in earlier.items():
        shown = shown.replace(f", {key}={value!r}", "")
    assert before.identity() == shown and all(f"{key}=" not in shown for key in earlier)
    after = cls(**later).identity()
    assert all(f"{key}={value!r}" in after for key, value in later.items())
    # a method without added fields is named by its repr
    assert METHODS.load("quest")().identity() == repr(METHODS.load("quest")())
