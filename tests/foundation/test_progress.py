"""Progress lines (scoutbench/progress.py)."""



def test_progress_lines_when_not_a_terminal():
    import io

    from scoutbench.progress import PhaseProgress

    stream = io.StringIO()
    with PhaseProgress(console=None, interval_s=0.0, stream=stream) as progress:
        for done in range(0, 5):
            progress.update("[1/1] scout decode", done, 4)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[1/1] scout decode: 1/4, ") and "ETA" in lines[0]
    assert lines[-1].endswith("done") and len(lines) == 4
