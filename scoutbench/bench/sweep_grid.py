"""Planning a sweep: its axes (`Grid`), the settings every point shares (`Settings`), the paper's presets, the
points a grid expands to (`SweepPoint`, `expand`) and the `--config` file that describes them; running and
resuming the points is `bench/sweep.py`.

Presets reproduce the paper's performance figures at two scales: `paper` (Qwen3-14B shapes, 8k-64k, each method
at its own largest batch as in the paper, `--batch auto`, or batch 16-64 for Figure 9: a GPU) and `cpu` (the
attention-dominated `bench-attn16` shape, 16 layers of which 2 dense as in the paper's models, at 4k-32k, batch
1-4: minutes on two cores). Every axis a preset sets can be overridden by the matching flag.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from scoutbench.errors import UsageError
from scoutbench.method_args import MethodSettings, SharedFlag, resolve_method_args
from scoutbench.methods import COMPARED_METHODS, PAPER_ABLATION_METHODS, PROPOSED_METHOD
from scoutbench.units import format_length

# the registry says which methods the paper's figures compare, which one they are about and its ablation
COMPARED = tuple(COMPARED_METHODS)
ABLATION = tuple(PAPER_ABLATION_METHODS)


@dataclass(frozen=True)
class Grid:
    """The axes of a sweep; `method_args` maps a field name to the values to sweep."""

    methods: tuple[str, ...]
    lengths: tuple[int, ...]
    batches: tuple[int | str, ...]  # a size, or "auto": each method's largest batch (scoutbench/planning.py)
    budgets: tuple[int | None, ...] = (None,)
    block_sizes: tuple[int | None, ...] = (None,)
    method_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    dense_layers: int | None = None  # one setting for every sparse method of the sweep (None: their default)


@dataclass(frozen=True)
class Settings:
    """What every point of a sweep shares; a rerun into the same folder must use the same settings."""

    model: str = "tiny-qwen3"
    steps: int = 32  # whole cycles of 32-token blocks: every method's per-block work at its rate (bench/throughput.py)
    warmup: int = 3
    device: str = "auto"
    dtype: str | None = None
    seed: int = 0
    # auto, as `throughput` (bench.resolve.resolve_prefill); the sweep command records the resolved one
    prefill: str = "auto"
    gpu_mem: int | None = None  # bytes, for batch "auto"
    host_mem: int | None = None


@dataclass(frozen=True)
class Scale:
    model: str
    lengths: tuple[int, ...]
    batches: tuple[int | str, ...]
    budget: int
    block_sizes: tuple[int, ...] = (32,)
    steps: int = 32  # whole block cycles of the largest block size (bench/throughput.py)
    warmup: int = 3


@dataclass(frozen=True)
class Preset:
    figure: str
    methods: tuple[str, ...]
    paper: Scale
    cpu: Scale

    def grid_and_settings(self, scale: str) -> tuple[Grid, Settings]:
        s = self.paper if scale == "paper" else self.cpu
        grid = Grid(self.methods, s.lengths, s.batches, (s.budget,), s.block_sizes)
        return grid, Settings(model=s.model, steps=s.steps, warmup=s.warmup)


K = 1024
# Paper setting (section 5): Qwen3-14B, sparse budget 2048, block size 32, decode only, methods compared at their own
# maximum batch (FullKV is capped by memory: that is the point of Figure 8). The CPU scale keeps the
# paper's budget/length ratios (1/4 .. 1/32) on the bench-attn16 shape, where attention dominates a step as it
# does on a GPU at long context. The paper does not name its three block sizes; 16/32/64 bracket its default.
_CPU_STEPS = dict(steps=32, warmup=2)
PRESETS: dict[str, Preset] = {
    "lengths": Preset("Figure 8: decode throughput vs input length", COMPARED,
                      Scale("qwen3-14b", (8 * K, 16 * K, 32 * K, 64 * K), ("auto",), 2048),
                      Scale("bench-attn16", (4 * K, 8 * K, 16 * K, 32 * K), (1,), 1024, **_CPU_STEPS)),
    "batch": Preset("Figure 9: decode throughput vs batch size", COMPARED,
                    Scale("qwen3-14b", (32 * K,), (16, 32, 64), 2048),
                    Scale("bench-attn16", (8 * K,), (1, 2, 4), 512, **_CPU_STEPS)),
    "block-size": Preset("Figure 10: ScoutAttention throughput vs block size", (PROPOSED_METHOD,),
                         Scale("qwen3-14b", (32 * K,), ("auto",), 2048, (16, 32, 64), steps=64),
                         Scale("bench-attn16", (16 * K,), (2,), 1024, (16, 32, 64), steps=64, warmup=2)),
    "breakdown": Preset("Figure 11: latency breakdown with GPU idle time", COMPARED,
                        Scale("qwen3-14b", (32 * K,), ("auto",), 2048),
                        Scale("bench-attn16", (16 * K,), (1,), 1024, **_CPU_STEPS)),
    "ablation": Preset("Figure 12: ablation, parallel co-attention then +PC then +PC+PR", ABLATION,
                       Scale("qwen3-14b", (32 * K,), ("auto",), 2048),
                       Scale("bench-attn16", (16 * K,), (1,), 1024, **_CPU_STEPS)),
}


@dataclass(frozen=True)
class SweepPoint:
    method: str
    length: int
    batch: int | str
    method_args: tuple[tuple[str, Any], ...] = ()
    # the sha256 of each file a method field names (`MethodArgs.file_fields`: a recall profile), by field: the
    # file's content decides the point, not its name (None: read when the point is made)
    inputs: tuple[tuple[str, str], ...] | None = None

    def __post_init__(self) -> None:
        if self.inputs is None:
            object.__setattr__(self, "inputs", input_digests(self.method, self.args))

    @property
    def args(self) -> dict[str, Any]:
        return dict(self.method_args)

    def point_id(self, model: str) -> str:
        """Deterministic file stem, e.g. `scout_bench-attn16_len16k_b1_block_size-32_budget-1024`; a hash is
        appended when the readable form had to be altered, so two different points never share a file. A file a
        field names is its stem and its content's hash (`recall_profile-p-3f2a9c0d1e`): two profiles named alike
        in two folders, or one profile edited, are two points, never one file written over."""
        digests = dict(self.inputs or ())
        parts = [self.method, model.replace("/", "--"), f"len{format_length(self.length)}", f"b{self.batch}"]
        parts += [f"{k}-{Path(str(v)).stem}-{digests[k][:10]}" if k in digests else f"{k}-{v}"
                  for k, v in self.method_args]
        readable = "_".join(parts)
        safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", readable).strip("._") or "point"
        if safe != readable or len(safe) > 150:
            identity = json.dumps([self.method, model, self.length, self.batch, self.method_args, self.inputs],
                                  default=str)
            safe = f"{safe[:150]}_{hashlib.sha1(identity.encode()).hexdigest()[:8]}"
        return safe

    def describe(self) -> dict[str, Any]:
        described = {"method": self.method, "len": self.length, "batch": self.batch, "method_args": self.args}
        return {**described, "inputs": dict(self.inputs)} if self.inputs else described

    def config(self, settings: Settings, command: list[str] | None = None) -> Any:
        """The ThroughputConfig this point runs with in a sweep of `settings`."""
        from scoutbench.bench.resolve import ThroughputConfig

        return ThroughputConfig(method=self.method, method_args=self.args, model=settings.model, length=self.length,
                                batch=self.batch, gpu_mem=settings.gpu_mem, host_mem=settings.host_mem,
                                steps=settings.steps, warmup=settings.warmup, device=settings.device,
                                dtype=settings.dtype, seed=settings.seed, prefill=settings.prefill,
                                command=command or ["scoutbench", "sweep"])

    def stamp(self, settings: Settings, record: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
        """What the point's file records (`sweep_point`): the point (its fields are JSON values already), the sweep's
        settings (`settings_record`, which a rerun into the folder must match) and the digest of the point's
        identity (`run_identity`), which a rerun compares before it counts the point as done."""
        identity = _identity_text(self.config(settings), environment, self.inputs or ())
        return {"settings": record, "point": self.describe(),
                "identity": "sha256:" + hashlib.sha256(identity.encode()).hexdigest()}


# ThroughputConfig fields that decide nothing a run computes or measures: how it was invoked
NOT_IDENTITY_FIELDS = ("command",)


def run_identity(cfg: Any, environment: dict[str, Any], inputs: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """Everything that decides what a run of `cfg` (a ThroughputConfig) computes and measures: every field of its
    configuration but NOT_IDENTITY_FIELDS, its method's full configuration (the preset's and the defaults' fields
    included, each file a field names by its content's sha256, `inputs`), and the environment that decides a run
    (`run_environment`). Two runs with equal identities measure the same thing; a resumed sweep counts a point as
    done only when its file records this identity (the sha256 of its canonical JSON)."""
    return json.loads(_identity_text(cfg, environment, inputs))


def _identity_text(cfg: Any, environment: dict[str, Any], inputs: tuple[tuple[str, str], ...]) -> str:
    """`run_identity` as canonical JSON (sorted keys), the text its digest is taken of."""
    from scoutbench.methods import METHODS, resolved_method_config

    run = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in NOT_IDENTITY_FIELDS}
    run["method"] = METHODS.canonical(cfg.method) if cfg.method in METHODS else cfg.method
    config = resolved_method_config(cfg.method, dict(cfg.method_args)) if cfg.method in METHODS else \
        dict(cfg.method_args)
    run["method_args"] = {**config, **{name: f"sha256:{digest}" for name, digest in inputs}}
    return json.dumps({"run": run, "environment": environment}, sort_keys=True, default=str)


def input_digests(method: str, args: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """(field, sha256 of the file it names) for each of `method`'s file fields set in `args`; a file that cannot
    be read (missing, not a regular file, over the size bound) is a usage error before anything runs."""
    from scoutbench.input_files import UnusableFile, read_regular_file
    from scoutbench.methods import METHODS, method_file_fields

    digests = []
    for name in method_file_fields(method) if method in METHODS else ():
        if args.get(name) is None:
            continue
        try:
            content = read_regular_file(str(args[name]))
        except UnusableFile as exc:
            raise UsageError(f"{method}: --method-arg {name}={args[name]}: {exc}") from None
        digests.append((name, hashlib.sha256(content).hexdigest()))
    return tuple(digests)


def run_environment(device: str) -> dict[str, Any]:
    """What decides a run besides its configuration: the environment variables that do (`environment.run_settings`)
    and the attention backends the run resolves to on its device and on the CPU (the compiled kernel or torch's;
    flashinfer, Triton or torch on CUDA), which a failed build or an install changes without any variable."""
    import torch

    from scoutbench.devices import resolve_device
    from scoutbench.environment import run_settings
    from scoutbench.kernels.backends import partial_backend

    return {**run_settings(), "attention_backend": partial_backend(resolve_device(device)),
            "cpu_attention_backend": partial_backend(torch.device("cpu"))}


def settings_record(settings: Settings, environment: dict[str, Any]) -> dict[str, Any]:
    """The settings as a sweep's files record them (JSON read back), with the environment that decides its runs
    (`run_environment`): a rerun into the folder under other values of either is refused."""
    return json.loads(json.dumps({**asdict(settings), "environment": environment}, default=str))


def expand(grid: Grid, defaults: frozenset[SharedFlag] = frozenset()) -> list[SweepPoint]:
    """Cartesian product of the axes, lengths outermost (an interrupted sweep has whole lengths done).

    Each point's method fields come from scoutbench.method_args (the rules every command shares): --budget,
    --block-size, --dense-layers and --method-arg apply only to methods with such a field (FullKV has no budget),
    so the product collapses where an axis does not apply. `defaults` are the flags whose values are a preset's
    sizes, not the user's: they are never an error.
    """
    keys = sorted(grid.method_args)
    combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*(grid.method_args[k] for k in keys))]
    # each method's distinct field settings, resolved once (they do not depend on length or batch: a grid of a
    # million points resolves its few settings, not a million), in the axes' order
    args_of: dict[str, dict[tuple[tuple[str, Any], ...], None]] = {method: {} for method in grid.methods}
    for budget, block_size, common in itertools.product(grid.budgets, grid.block_sizes, combos):
        settings = MethodSettings.of(common, budget=budget, block_size=block_size, dense_layers=grid.dense_layers,
                                     defaults=defaults)
        for method, args in resolve_method_args(list(grid.methods), settings).items():
            args_of[method][tuple(sorted(args.items()))] = None
    # each setting's files read once, not once per point
    inputs = {(method, args): input_digests(method, dict(args)) for method in grid.methods for args in args_of[method]}
    points: dict[SweepPoint, None] = {}
    for length, batch, method in itertools.product(grid.lengths, grid.batches, grid.methods):
        for args in args_of[method]:
            points[SweepPoint(method, length, batch, args, inputs[method, args])] = None
    return list(points)


# ---- --config -------------------------------------------------------------------------------------------------

def read_config(path: str | Path) -> dict[str, Any]:
    """A sweep config file: YAML (.yaml/.yml) or TOML (.toml), a mapping of option names to values."""
    from scoutbench.input_files import UnusableFile, read_regular_file

    path = Path(path)
    try:
        text = read_regular_file(path).decode("utf-8")  # a regular file, bounded: a FIFO would block here
        if path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            raise UsageError(f"--config {path}: use a .yaml, .yml or .toml file")
    except (OSError, ValueError, UnusableFile) as exc:  # yaml's and toml's errors are ValueErrors or close to them
        raise UsageError(f"--config {path}: {str(exc).strip().splitlines()[0]}") from None
    except Exception as exc:  # noqa: BLE001 - yaml's own errors: one line, never a traceback
        raise UsageError(f"--config {path}: {str(exc).strip().splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of option names to values, got {type(data).__name__}")
    return data


def config_defaults(config: dict[str, Any], by_flag: dict[str, tuple[str, bool]]) -> dict[str, Any]:
    """Config entries as the command's defaults: keys are long flag names (dashes or underscores), lists become
    repeated values, `method_arg` may be a mapping of field -> value(s)."""
    import difflib

    defaults: dict[str, Any] = {}
    for key, value in config.items():
        flag = str(key).replace("-", "_")
        if flag not in by_flag:
            close = difflib.get_close_matches(flag, list(by_flag), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"--config: unknown option {key!r}{hint} (keys are the sweep flags' long names)")
        if value is None:
            continue
        if flag == "method_arg" and isinstance(value, dict):
            value = [f"{field}={item}" for field, items in value.items()
                     for item in (items if isinstance(items, list) else [items])]
        name, multiple = by_flag[flag]
        if multiple:  # a repeatable flag: a list, or one value
            value = tuple(str(item) for item in (value if isinstance(value, list) else [value]))
        elif isinstance(value, (list, dict)):
            raise UsageError(f"--config: {key!r} takes one value, got {value!r}")
        else:  # as the command line gives it: a string that the option's own type parses (a flag takes true/false),
            # so YAML's `true` is no step count and 2.5 no integer (click would take them as 1 and 2, and `.inf` would raise)
            value = str(value)
        defaults[name] = value
    return defaults


def write_config(path: Path, config: dict[str, Any]) -> None:
    import yaml

    from scoutbench.analysis.export import write_text

    text = ("# scoutbench sweep: the resolved grid and settings of this folder; rerun or resume it with\n"
            f"#   scoutbench sweep --config {path} -o {path.parent}\n"
            + yaml.safe_dump({k: v for k, v in config.items() if v not in (None, [], {})}, sort_keys=False))
    write_text(path, text, overwrite=True)
