"""The tier of a test is its directory (tests/tiers.py): an unmarked file gets its
directory's marker, and a marker that disagrees with the directory fails collection."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

MARKED_NATS = "import pytest\npytestmark = pytest.mark.nats\n\ndef test_wrong_tier():\n    pass\n"
UNMARKED = "def test_{name}():\n    pass\n"


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_inprocess("-p", "tests.tiers", "-p", "no:cacheprovider", *args)


def test_a_marker_that_disagrees_with_its_directory_fails_collection(pytester):
    pytester.makepyfile(**{"tests/unit/test_misplaced": MARKED_NATS, "tests/nats/test_fine": UNMARKED.format(name="fine")})
    res = run(pytester, "--collect-only")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    err = res.stderr.str()
    assert "tiers disagree with their directories" in err, err
    assert "tests/unit/test_misplaced.py::test_wrong_tier: marked ['nats'] but lives in tests/unit/" in err, err
    assert "test_fine" not in err, "only the misplaced test is named"


def test_an_unmarked_file_gets_its_directorys_tier(pytester):
    pytester.makepyfile(**{"tests/unit/test_u1": UNMARKED.format(name="u"), "tests/e2e/test_e1": UNMARKED.format(name="e"),
                           "tests/heavy/test_h1": UNMARKED.format(name="h")})
    assert run(pytester, "-m", "unit").parseoutcomes() == {"passed": 1, "deselected": 2}
    res = run(pytester, "-m", "e2e or heavy", "-v")
    res.stdout.fnmatch_lines(["*test_e1.py::test_e PASSED*", "*test_h1.py::test_h PASSED*"])
    assert res.parseoutcomes()["passed"] == 2
