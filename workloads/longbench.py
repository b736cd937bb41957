"""LongBench v1 (all 21 datasets, 13 LongBench-E files), prompted and truncated exactly as the official `pred.py`
(THUDM/LongBench, `LongBench/`, with the prompts and lengths of its `config/` files).

A record becomes model input in four steps, each as the official code does it:
1. fill the dataset's template (`scoutbench/data/dataset2prompt.json`, verbatim, typos included) with `str.format`;
2. middle-truncate the filled prompt at text level when it has more than `max_length` tokens (counted with the
   tokenizer's default special tokens, BOS included): decode of the first half + decode of the last half;
3. wrap it in the model's chat template, except for trec, triviaqa, samsum, lsht, lcc and repobench-p;
4. tokenize (template output without extra special tokens, so BOS is never doubled).

Data comes from a folder of official `<name>.jsonl` files (`--data-dir`), a parquet mirror of them (the same
folder with `<name>.parquet` or `<name>/**/*.parquet`, read through `datasets` as an Arrow dataset), or the hub
archive `data.zip` of `zai-org/LongBench` (`THUDM/LongBench` only redirects there; datasets>=4 can no longer run its
loading script, so the archive is read directly). Every load also says where its records came from
(`data_source`: the file, its sha256, the hub commit), which accuracy results record per dataset.
The module does not import torch (the `score` command uses its record reader).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from scoutbench.errors import ScoutbenchError, UsageError
from scoutbench.workloads import longbench_metrics as metrics
from scoutbench.workloads.suite import Suite, TaskSettings

# The dataset registry lives with the metrics (torch-free, shared with `scoutbench score`).
DATASETS = metrics.DATASETS
E_DATASETS = metrics.E_DATASETS
check_dataset = metrics.check_dataset
# The official pred.py feeds these without the chat wrapper ("chat models are better off without" it).
NO_CHAT_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
# Datasets that also stop at a newline (and must generate at least one token), as pred.py does for samsum.
NEWLINE_STOP_DATASETS = frozenset({"samsum"})

HUB_REPO = "zai-org/LongBench"  # THUDM/LongBench redirects here
HUB_ARCHIVE = "data.zip"
DATA_HINT = (f"download {HUB_ARCHIVE} from https://huggingface.co/datasets/{HUB_REPO}, unzip it and pass "
             "--data-dir DIR (DIR/<name>.jsonl)")

# Prompt-token limit for truncation, per model (the official model2maxlen.json). The official convention is the
# context window minus ~500 tokens for the chat wrapper and the answer (3500 for 4k models, 7500 for 8k).
# SmolLM2-135M accepts 8192 positions but only answers sensibly up to ~2k tokens, so its default is 2k - 500;
# the Qwen2.5 models are 32k models (31500, as the official table's 32k entries).
MODEL_MAX_LENGTH = {"smollm2-135m": 1500, "qwen2.5-0.5b": 31500, "qwen2.5-1.5b": 31500}
CHAT_AND_ANSWER_RESERVE_TOKENS = 500


@functools.cache
def templates() -> dict[str, str]:
    return json.loads(resources.files("scoutbench").joinpath("data/dataset2prompt.json").read_text("utf-8"))


@functools.cache
def max_new_tokens_table() -> dict[str, int]:
    return json.loads(resources.files("scoutbench").joinpath("data/dataset2maxlen.json").read_text("utf-8"))


def default_max_length(model_name: str, config: Any) -> int:
    """The documented per-model prompt limit; otherwise the official rule: context window minus 500 tokens."""
    if model_name in MODEL_MAX_LENGTH:
        return MODEL_MAX_LENGTH[model_name]
    window = getattr(config, "max_position_embeddings", None)
    if not window or window <= CHAT_AND_ANSWER_RESERVE_TOKENS:
        raise UsageError(f"model {model_name!r} has no usable context window in its config; pass --max-length")
    return window - CHAT_AND_ANSWER_RESERVE_TOKENS


# ---------------------------------------------------------------------------------------------- records
def iter_jsonl(lines: Iterable[str], source: str,
               error: type[ScoutbenchError] = UsageError) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line; a line that is not JSON raises `error` naming the
    source and line (records and prediction files share this format)."""
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield line_number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{source} line {line_number}: not valid JSON ({exc.msg})") from None


def parse_records(lines: Iterable[str], source: str) -> list[dict[str, Any]]:
    """Official records, one JSON object per line. Unknown keys are kept; blank lines are skipped."""
    return [_official_record(record, f"{source} line {line_number}")
            for line_number, record in iter_jsonl(lines, source)]


def _records(lines: Iterable[str], source: str) -> list[dict[str, Any]]:
    """The records of a data file (`parse_records`); text that is not UTF-8 and a file without a record are bad
    input (exit 2), like a malformed line."""
    try:
        records = parse_records(lines, source)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{source}: not UTF-8 text ({exc.reason}); save it as UTF-8, or {DATA_HINT}") from None
    if not records:
        raise UsageError(f"{source}: no records; {DATA_HINT}")
    return records


def _official_record(record: dict[str, Any], where: str) -> dict[str, Any]:
    """`record` checked as an official LongBench record (a problem is an error naming `where`), with the optional
    `all_classes` present."""
    problem = _record_problem(record)
    if problem:
        raise UsageError(f"{where}: {problem}")
    record.setdefault("all_classes", None)
    return record


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return "not a JSON object"
    for key in ("input", "context"):
        if not isinstance(record.get(key), str):
            return f"field {key!r} must be a string"
    answers = record.get("answers")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        return "field 'answers' must be a non-empty list of strings"
    if not isinstance(record.get("length"), int) or isinstance(record.get("length"), bool):
        return "field 'length' must be an integer"
    return None


def load_records(name: str, data_dir: str | Path | None = None, revision: str | None = None) -> list[dict[str, Any]]:
    """All records of dataset `name`: from `data_dir` (official `<name>.jsonl`, else a parquet mirror), or from the
    hub archive at `revision` (default: the repo's main branch) when no folder is given."""
    return load_task_data(name, data_dir, revision)[0]


def load_task_data(name: str, data_dir: str | Path | None = None,
                   revision: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(records, source): the records as `load_records` returns them and where they came from (`data_source`)."""
    check_dataset(name)
    if data_dir is not None:
        path = Path(data_dir) / f"{name}.jsonl"
        if path.is_file():
            with open(path, encoding="utf-8-sig") as lines:  # a byte-order mark is not part of the JSON
                return _records(lines, str(path)), {"kind": "folder", "file": str(path.resolve()),
                                                    "sha256": file_sha256(path)}
        parquet = parquet_files(name, data_dir)
        if parquet:
            return _records_from_arrow(arrow_dataset(name, data_dir), name), {
                "kind": "parquet", "files": [str(f.resolve()) for f in parquet],
                "sha256": [file_sha256(f) for f in parquet], "loader": f"datasets {_datasets_version()}"}
        raise UsageError(f"no LongBench data for {name}: {path} does not exist; {DATA_HINT}")
    archive = _hub_archive(name, revision)
    member = f"data/{name}.jsonl"
    try:
        with zipfile.ZipFile(archive) as bundle:
            if member not in bundle.namelist():
                raise ScoutbenchError(f"{archive} has no {member}; {DATA_HINT}")
            with bundle.open(member) as raw:
                records = _records(io.TextIOWrapper(raw, encoding="utf-8-sig"), f"{archive}:{member}")
    except (zipfile.BadZipFile, OSError) as exc:  # a download cut short in the Hugging Face cache
        raise ScoutbenchError(f"{archive} is not a readable zip archive ({exc}); delete it to download it again, "
                              f"or {DATA_HINT}") from None
    # the cache path is .../snapshots/<commit>/data.zip: the commit the requested revision resolved to
    commit = Path(archive).parent.name if Path(archive).parent.parent.name == "snapshots" else None
    return records, {"kind": "hub", "repo": HUB_REPO, "revision": revision or "main", "commit": commit,
                     "file": HUB_ARCHIVE, "member": member, "sha256": file_sha256(Path(archive))}


@functools.lru_cache(maxsize=64)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a data file (hashed once per process while its size and mtime stay the same)."""
    stat = path.stat()
    return _sha256_cached(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def _hub_archive(name: str, revision: str | None = None) -> str:
    """The hub's data.zip (downloaded once into the Hugging Face cache). Offline, only the cache is tried, so the
    error comes at once instead of after a minute of retries."""
    from scoutbench.models import hub_offline

    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ScoutbenchError(f"no LongBench data for {name} (huggingface_hub is not installed); {DATA_HINT}") from None
    local_only = hub_offline()
    try:
        return hf_hub_download(HUB_REPO, HUB_ARCHIVE, repo_type="dataset", revision=revision,
                               local_files_only=local_only)
    except Exception as exc:  # offline, unreachable, gated or renamed: all mean "bring the files yourself"
        why = ("offline, and data.zip is not in the Hugging Face cache" if local_only
               else f"the download failed ({(str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]})")
        raise ScoutbenchError(f"no LongBench data for {name}: {why}; {DATA_HINT}") from None


# ---------------------------------------------------------------------------------------------- Arrow (datasets)
DATASETS_HINT = 'pip install "scoutbench[datasets]"'


def parquet_files(name: str, data_dir: str | Path) -> list[Path]:
    """A parquet mirror's files for `name`: `<name>.parquet`, or every parquet under `<name>/` (the hub's parquet
    conversion writes `<name>/test/0000.parquet`), in name order."""
    folder = Path(data_dir)
    single = folder / f"{name}.parquet"
    if single.is_file():
        return [single]
    return sorted((folder / name).rglob("*.parquet")) if (folder / name).is_dir() else []


def arrow_dataset(name: str, data_dir: str | Path, cache_dir: str | Path | None = None) -> Any:
    """Dataset `name` of a local LongBench folder (official `<name>.jsonl`) or of a parquet mirror, as a
    `datasets.Dataset`: Arrow, memory-mapped, and cached by datasets under `cache_dir` (default: its own cache,
    keyed by the files' contents, so a second load reads the Arrow file instead of parsing again)."""
    try:
        import datasets
    except ImportError:
        raise ScoutbenchError(f"loading {name} as an Arrow dataset needs the datasets package: {DATASETS_HINT}") from None
    check_dataset(name)
    jsonl = Path(data_dir) / f"{name}.jsonl"
    files = [jsonl] if jsonl.is_file() else parquet_files(name, data_dir)
    if not files:
        raise ScoutbenchError(f"no LongBench data for {name} in {data_dir} (<name>.jsonl, <name>.parquet or "
                              f"<name>/**/*.parquet); {DATA_HINT}")
    builder = "json" if files[0].suffix == ".jsonl" else "parquet"
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a file it cannot read is logged, then raised
    try:
        # a damaged Arrow cache (a killed or full-disk write) is rebuilt from the files once; what still fails is
        # the files themselves
        for mode in (None, datasets.DownloadMode.FORCE_REDOWNLOAD):
            try:
                return datasets.load_dataset(builder, data_files={"test": [str(f) for f in files]}, split="test",
                                             cache_dir=None if cache_dir is None else str(cache_dir),
                                             download_mode=mode)
            except Exception as exc:  # noqa: BLE001 - pyarrow's and datasets' own errors for what they cannot read
                failure = exc
    finally:
        datasets.logging.set_verbosity(verbosity)
    from scoutbench.models import first_line

    raise UsageError(f"cannot read {name} from {', '.join(str(f) for f in files)}: "
                     f"{first_line(failure.__cause__ or failure)}; check or replace the mirror's files, or {DATA_HINT}")


def _records_from_arrow(dataset: Any, name: str) -> list[dict[str, Any]]:
    """Rows of an Arrow dataset as official records, checked like lines of a .jsonl file."""
    return [_official_record(record, f"{name} (Arrow) row {index}") for index, record in enumerate(dataset.to_list())]


def _datasets_version() -> str:
    from importlib import metadata

    return metadata.version("datasets")


def cross_check(records: list[dict[str, Any]], reference: list[dict[str, Any]]) -> list[str]:
    """Record-by-record differences between a mirror's records and the official ones, matched by `_id`: ids
    missing or extra, duplicated, and every field whose value differs. Empty when the mirror is faithful."""
    problems: list[str] = []
    by_id: dict[str, dict[str, Any]] = {}
    for record in records:
        key = str(record.get("_id"))
        if key in by_id:
            problems.append(f"_id {key}: duplicated in the mirror")
        by_id[key] = record
    official_ids = {str(r.get("_id")) for r in reference}
    for official in reference:
        key = str(official.get("_id"))
        mirror = by_id.get(key)
        if mirror is None:
            problems.append(f"_id {key}: missing from the mirror")
            continue
        differing = sorted(field for field in official.keys() | mirror.keys()
                           if official.get(field) != mirror.get(field))
        if differing:
            problems.append(f"_id {key}: {', '.join(differing)} differ")
    problems += [f"_id {key}: not in the official data" for key in by_id if key not in official_ids]
    return problems


# ---------------------------------------------------------------------------------------------- prompts
def fill_template(dataset: str, record: dict[str, Any]) -> str:
    return templates()[metrics.base_dataset(dataset)].format(**record)


def truncate_middle(prompt: str, tokenizer: Any, max_length: int) -> str:
    """pred.py's truncation: count tokens with default special tokens; if over, keep the decoded first and last
    `floor(max_length / 2)` tokens (special tokens skipped), joined with no separator."""
    token_ids = tokenizer(prompt, truncation=False).input_ids
    if len(token_ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return (tokenizer.decode(token_ids[:half], skip_special_tokens=True)
            + tokenizer.decode(token_ids[-half:], skip_special_tokens=True))


def truncate_middle_ids(prompt_ids: list[int], length: int) -> list[int]:
    """The first and last halves of `prompt_ids` when longer than `length` tokens (pred.py's middle truncation at
    token level): a prompt of exactly `length` tokens, where the text-level truncation and the chat template land
    a few tokens off."""
    if len(prompt_ids) <= length:
        return list(prompt_ids)
    head = length // 2
    return list(prompt_ids[:head]) + list(prompt_ids[len(prompt_ids) - (length - head):])


def uses_chat_template(dataset: str) -> bool:
    return metrics.base_dataset(dataset) not in NO_CHAT_DATASETS


@dataclass
class LongBenchTask:
    """One dataset, ready for the accuracy runner: inputs, generation limits, stop tokens and the official score."""

    dataset: str  # e.g. "qasper" or "qasper_e"
    records: list[dict[str, Any]]
    tokenizer: Any
    max_length: int
    source: dict[str, Any] | None = None  # where the records came from (load_task_data), recorded in results

    def __post_init__(self) -> None:
        check_dataset(self.dataset)
        if self.max_length < 2:
            raise UsageError(f"--max-length must be at least 2 tokens, got {self.max_length}")

    @property
    def name(self) -> str:
        return self.dataset

    @property
    def max_new_tokens(self) -> int:
        return max_new_tokens_table()[metrics.base_dataset(self.dataset)]

    @property
    def min_new_tokens(self) -> int:
        """samsum: min_length = prompt + 1 in pred.py, so the first token can be neither EOS nor newline."""
        return 1 if metrics.base_dataset(self.dataset) in NEWLINE_STOP_DATASETS else 0

    def stop_token_ids(self, model_eos_ids: frozenset[int]) -> frozenset[int]:
        """The model's EOS; for samsum pred.py replaces it by [tokenizer EOS, last id of encode("\\n")]."""
        if metrics.base_dataset(self.dataset) in NEWLINE_STOP_DATASETS:
            newline_id = self.tokenizer.encode("\n", add_special_tokens=False)[-1]
            return frozenset({self.tokenizer.eos_token_id, newline_id})
        return model_eos_ids

    def prompt(self, record: dict[str, Any]) -> str:
        """Filled and truncated prompt, before the chat wrapper."""
        return truncate_middle(fill_template(self.dataset, record), self.tokenizer, self.max_length)

    def input_ids(self, record: dict[str, Any]) -> list[int]:
        from scoutbench.models import encode_prompt

        return encode_prompt(self.tokenizer, self.prompt(record), chat=uses_chat_template(self.dataset))

    def describe(self) -> dict[str, Any]:
        return {"metric": metrics.metric_name(self.dataset), "max_new_tokens": self.max_new_tokens,
                "max_length": self.max_length, "chat_template": uses_chat_template(self.dataset),
                "data": self.source}

    def score(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Official aggregation; `_e` datasets also get the LongBench-E length buckets."""
        result: dict[str, Any] = {"score": metrics.dataset_score(self.dataset, rows)}
        if self.dataset.endswith("_e"):
            result["buckets"] = metrics.dataset_score_e(self.dataset, rows)
        return result


# ---------------------------------------------------------------------------------------------- the suite
class LongBenchSuite(Suite):
    """LongBench v1's 21 datasets and the 13 LongBench-E files, read from a folder, a parquet mirror or the hub
    archive; `all` stands for the 21."""

    usage = f"LongBench: {', '.join(DATASETS)}, their _e variants, or 'all'"

    def datasets(self) -> tuple[str, ...]:
        return (*DATASETS, *E_DATASETS)

    def groups(self) -> dict[str, tuple[tuple[str, ...], str]]:
        return {"all": (DATASETS, f"the {len(DATASETS)} LongBench v1 datasets")}

    def listing(self) -> list[dict[str, str]]:
        return [{"name": name, "suite": "LongBench-E" if name.endswith("_e") else "LongBench",
                 "metric": metrics.metric_name(name)} for name in self.datasets()]

    def load_records(self, dataset: str, data_dir: str | Path | None,
                     revision: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return load_task_data(dataset, data_dir, revision)

    def task(self, dataset: str, tokenizer: Any, records: list[dict[str, Any]] | None, source: dict[str, Any] | None,
             settings: TaskSettings) -> LongBenchTask:
        return LongBenchTask(dataset, records or [], tokenizer, settings.max_length, source=source)

    def default_max_length(self, model_name: str, config: Any) -> int | None:
        return default_max_length(model_name, config)

    def check_context(self, dataset: str, model: str, window: int | None, settings: TaskSettings) -> None:
        """Prompts are middle-truncated to --max-length (as the official pred.py does; the default leaves the
        official 500 tokens for the chat wrapper and the answer), then the dataset's answer length is added."""
        if settings.max_length is None:
            return
        from scoutbench.models import check_context

        answer = max_new_tokens_table()[metrics.base_dataset(dataset)]
        check_context(model, window, settings.max_length + answer,
                      f"{dataset} prompts truncated to --max-length {settings.max_length} plus a {answer}-token "
                      "answer", "lower --max-length (or omit it: the default fits)")


SUITE = LongBenchSuite()
