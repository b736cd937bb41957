"""`scoutbench data-check`: is a LongBench mirror (a parquet conversion, another folder) the official data?"""

from __future__ import annotations

import click


@click.command(name="data-check")
@click.argument("mirror", type=click.Path(exists=True, file_okay=False))
@click.option("--against", "reference", required=True, type=click.Path(exists=True, file_okay=False),
              help="Folder of the official LongBench <name>.jsonl files (the unzipped data.zip).")
@click.option("--dataset", "datasets", multiple=True,
              help="Datasets to check (repeatable; default: every official file in --against).")
def check_command(mirror, reference, datasets):
    """Load each dataset from MIRROR (a parquet mirror through `datasets`, or <name>.jsonl files) and compare it
    with the official file record by record, matched by `_id`. Exit 1 listing every difference."""
    from pathlib import Path

    from scoutbench.errors import ScoutbenchError, UsageError
    from scoutbench.workloads import longbench

    names = list(datasets) or sorted(p.stem for p in Path(reference).glob("*.jsonl")
                                     if p.stem in (*longbench.DATASETS, *longbench.E_DATASETS))
    if not names:
        raise UsageError(f"no official LongBench <name>.jsonl files in {reference}; pass --against the unzipped "
                         "data.zip folder")
    failed = 0
    for name in names:
        records, source = longbench.load_task_data(name, mirror)
        problems = longbench.cross_check(records, longbench.load_records(name, reference))
        click.echo(f"{name}: {len(records)} records from {source['kind']}: "
                   f"{'identical' if not problems else f'{len(problems)} difference(s)'}")
        for problem in problems:
            click.echo(f"  {problem}")
        failed += bool(problems)
    if failed:
        raise ScoutbenchError(f"{failed} of {len(names)} datasets differ from the official files")
