"""docs/outcomes.md's codes for the read-only commands against a real nats-server (issue
39, item 7): `status` of a job the cluster does not have exits 2 (as `cancel` of one
does), `jobs` of an empty cluster exits 0. tests/unit/test_outcomes.py has the cases that
need no server."""

from __future__ import annotations

import pytest

from prefixflow.shared.outcomes import Exit
from tests.conftest import run_cli

pytestmark = pytest.mark.timeout(60)


def test_status_of_an_unknown_job_is_a_usage_error_and_jobs_of_none_is_ok(nats_server):
    unknown = run_cli("status", "no-such-job", "--nats", nats_server.url, timeout=30)
    assert unknown.returncode == Exit.USAGE, unknown
    assert unknown.stderr == "error: no job 'no-such-job' in the cluster (never submitted, or expired)\n", unknown.stderr
    listed = run_cli("jobs", "--nats", nats_server.url, "--json", timeout=30)
    assert listed.returncode == Exit.OK and listed.stdout.strip() == "[]", listed
