"""No module of the package over 500 lines (scoutbench/, methods/, workloads/): a file that grows past it is split by
concern (a method's statistics, its work model, its trace beside its runtime), so that each reads on a few screens."""

from repo_paths import REPO_ROOT

MAX_LINES = 500


def test_no_module_is_over_500_lines():
    sizes = {str(path.relative_to(REPO_ROOT)): len(path.read_text(encoding="utf-8").splitlines())
             for folder in ("scoutbench", "methods", "workloads") for path in (REPO_ROOT / folder).rglob("*.py")}
    assert sizes and {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
