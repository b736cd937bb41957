"""LongBench through `datasets`: a local folder or a parquet mirror as a cached Arrow dataset,
cross-checked record by record (`_id`) against the official files, and `scoutbench data-check`."""

import importlib.util
import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from repo_paths import SHARED, TEST_DATA

from scoutbench.errors import ScoutbenchError
from scoutbench.workloads import longbench as lb

SHARED_RECORDS = SHARED / "longbench" / "records"
TESTS = TEST_DATA / "longbench"
FOLDERS = [folder for folder in (SHARED_RECORDS, TESTS) if folder.is_dir()]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("datasets") is None,
                                reason='needs datasets: pip install "scoutbench[datasets]"')


def _official(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.jsonl") if p.stem in (*lb.DATASETS, *lb.E_DATASETS))


def _parquet_mirror(folder: Path, out: Path, layout: str = "flat") -> Path:
    """What a hub parquet conversion gives: the official records as parquet (`<name>.parquet`, or the hub's
    `<name>/test/0000.parquet`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in _official(folder):
        rows = lb.load_records(name, folder)
        target = out / f"{name}.parquet" if layout == "flat" else out / name / "test" / "0000.parquet"
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), target)
    return out


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.parent.name)
def test_arrow_dataset_of_a_folder_is_the_official_records_and_cached(folder, tmp_path):
    cache = tmp_path / "cache"
    for name in _official(folder):
        dataset = lb.arrow_dataset(name, folder, cache_dir=cache)
        assert dataset.cache_files and all(Path(f["filename"]).is_relative_to(cache) for f in dataset.cache_files)
        assert lb.cross_check(lb._records_from_arrow(dataset, name), lb.load_records(name, folder)) == []
        again = lb.arrow_dataset(name, folder, cache_dir=cache)  # the second load reads the Arrow cache
        assert [f["filename"] for f in again.cache_files] == [f["filename"] for f in dataset.cache_files]


@pytest.mark.parametrize("layout", ["flat", "hub"])
def test_parquet_mirror_loads_and_matches_record_by_record(layout, tmp_path):
    folder = FOLDERS[0]
    mirror = _parquet_mirror(folder, tmp_path / "mirror", layout)
    for name in _official(folder):
        records, source = lb.load_task_data(name, mirror)
        assert source["kind"] == "parquet" and source["loader"].startswith("datasets ")
        assert len(source["sha256"]) == len(source["files"]) == 1
        assert lb.cross_check(records, lb.load_records(name, folder)) == []
        assert records == lb.load_records(name, folder)  # same order and fields as the official reader


def test_cross_check_names_each_difference():
    # the bundled records of every task (present in any checkout; ../shared/longbench exists only beside this one)
    official = [record for name in _official(TESTS) for record in lb.load_records(name, TESTS)]
    assert len(official) >= 4
    mirror = [dict(r) for r in official]
    mirror[0]["answers"] = ["a different answer"]
    mirror[1]["context"] += " (edited)"
    mirror[1]["length"] += 1
    dropped = mirror.pop(2)
    mirror.append({**official[3]})  # a duplicate
    mirror.append({**official[0], "_id": "not-official"})
    problems = lb.cross_check(mirror, official)
    assert f"_id {official[0]['_id']}: answers differ" in problems
    assert f"_id {official[1]['_id']}: context, length differ" in problems
    assert f"_id {dropped['_id']}: missing from the mirror" in problems
    assert f"_id {official[3]['_id']}: duplicated in the mirror" in problems
    assert "_id not-official: not in the official data" in problems
    assert len(problems) == 5


def test_data_check_command(tmp_path, monkeypatch, capsys):
    folder = FOLDERS[0]
    mirror = _parquet_mirror(folder, tmp_path / "mirror")
    code, out, err = run_cli(monkeypatch, capsys, "data-check", mirror, "--against", folder)
    assert code == 0, err
    assert all(f"{name}: " in out and "identical" in out for name in _official(folder))
    import pyarrow.parquet as pq

    name = _official(folder)[0]
    table = pq.read_table(mirror / f"{name}.parquet").to_pylist()
    table[0]["answers"] = ["tampered"]
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(table), mirror / f"{name}.parquet")
    code, out, err = run_cli(monkeypatch, capsys, "data-check", mirror, "--against", folder, "--dataset", name)
    assert code == 1 and f"_id {table[0]['_id']}: answers differ" in out
    assert "1 of 1 datasets differ" in err


def test_missing_mirror_data_says_where_to_put_it(tmp_path):
    with pytest.raises(ScoutbenchError, match=r"qasper\.jsonl does not exist"):
        lb.load_task_data("qasper", tmp_path)
    (tmp_path / "qasper.parquet").write_text(json.dumps({}))  # not parquet at all
    with pytest.raises(Exception):  # noqa: B017 - datasets/pyarrow's own error for a corrupt file
        lb.load_task_data("qasper", tmp_path)


def test_a_damaged_arrow_cache_is_rebuilt_from_the_files(tmp_path):
    """A truncated Arrow file in the datasets cache (a killed or full-disk write) failed every later load, blamed on
    the data ("check or replace the mirror's files"): the cache is rebuilt from the files once instead. Loaded in a
    child process: the Arrow file is memory-mapped."""
    import os
    import subprocess
    import sys

    folder, cache = TESTS, tmp_path / "cache"
    name = _official(folder)[0]
    first = lb.arrow_dataset(name, folder, cache_dir=cache)
    (arrow,) = {f["filename"] for f in first.cache_files}
    del first
    os.truncate(arrow, os.path.getsize(arrow) // 2)
    probe = (f"from scoutbench.workloads import longbench as lb; d = lb.arrow_dataset({name!r}, {str(folder)!r}, "
             f"cache_dir={str(cache)!r}); print(lb.cross_check(lb._records_from_arrow(d, {name!r}), "
             f"lb.load_records({name!r}, {str(folder)!r})))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:]
