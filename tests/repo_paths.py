"""Where the tests find the repository, their data and the shared folder beside a checkout: one definition for
test files at any depth of tests/."""

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
TEST_DATA = TESTS_DIR / "data"
SHARED = REPO_ROOT.parent / "shared"
