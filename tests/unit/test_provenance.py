"""Result provenance (prefixflow/shared/wire/provenance.py): a replica's result is written
only with the grant of its assignment; the grants and the origins a role may publish
under; the key's format; and which of `cluster config`'s env files hold the key."""

from __future__ import annotations

import secrets

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.shared.process.config import EngineWorkerConfig, SinkConfig
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import provenance as pv
from prefixflow.shared.wire import subjects
from tests.unit.test_security import allowed, env_of, run_config

KEY = bytes(range(32))
names = st.text(alphabet="abcxyz019-_", min_size=1, max_size=12).filter(lambda n: not n.startswith("_"))
ids = st.one_of(st.integers(min_value=0, max_value=2**40), st.text(min_size=1, max_size=20))


def answered(job: str, pid, routed_to: str, key: bytes | None, answered_by: str | None = None) -> m.Result:
    """The result `answered_by` (default: the replica it was routed to) publishes for a
    prompt the bucketer routed to `routed_to`, through the wire both ways."""
    prompt = m.Prompt(job, pid, b"\x00\x00\x00\x01")
    pv.sign(key, [prompt], routed_to)
    prompt = msgspec.msgpack.decode(m.encode(m.WorkBatch("b", [prompt])), type=m.WorkBatch).prompts[0]
    result = m.Result(pid, output="x", replica=answered_by or routed_to, grant=prompt.grant)
    return msgspec.msgpack.decode(m.encode(m.ResultBatch(job, [result])), type=m.ResultBatch).results[0]


@given(job=names, pid=ids, replica=names)
def test_the_replica_a_prompt_was_routed_to_may_answer_it(job, pid, replica):
    assert pv.refusal(KEY, job, replica, answered(job, pid, replica, KEY)) is None


@given(job=names, pid=ids, routed=names, other=names)
def test_no_other_replica_may_answer_it_even_naming_itself_truthfully(job, pid, routed, other):
    if other == routed:
        return
    # The other replica copies the routed one's grant (it saw the prompt, say): refused.
    stolen = answered(job, pid, routed, KEY, answered_by=other)
    assert "holds no assignment" in pv.refusal(KEY, job, other, stolen)
    # Or claims to be the routed replica while publishing under its own origin: refused.
    posing = answered(job, pid, routed, KEY)
    assert "came from" in pv.refusal(KEY, job, other, posing)


@given(job=names, pid=ids, replica=names, other_job=names, other_id=ids, grant=st.binary(max_size=16))
def test_a_grant_is_for_one_job_and_one_id(job, pid, replica, other_job, other_id, grant):
    result = answered(job, pid, replica, KEY)
    if other_job != job:
        assert pv.refusal(KEY, other_job, replica, result) is not None
    if other_id != pid:
        moved = msgspec.structs.replace(result, id=other_id)
        assert pv.refusal(KEY, job, replica, moved) is not None
    forged = msgspec.structs.replace(result, grant=grant)
    assert (pv.refusal(KEY, job, replica, forged) is None) == (grant == result.grant)
    unsigned = answered(job, pid, replica, None)  # made without a key: no grant
    assert unsigned.grant == b"" and pv.refusal(KEY, job, replica, unsigned) is not None
    assert pv.refusal(secrets.token_bytes(32), job, replica, result) is not None, "another fleet's key"


@given(job=names, pid=ids, replica=names)
def test_without_a_key_only_the_origin_is_checked(job, pid, replica):
    result = answered(job, pid, replica, None)
    assert pv.refusal(None, job, replica, result) is None
    assert pv.refusal(None, job, replica + "x", result) is not None


def test_services_error_rows_need_no_grant_their_origin_is_their_own():
    row = m.error_result(3, "empty prompt")
    for origin in (subjects.ORIGIN_INGESTOR, subjects.ORIGIN_BUCKETER):
        assert pv.refusal(KEY, "j", origin, row) is None
    assert pv.refusal(KEY, "j", "_other", row) is not None, "only the services' own origins"


def test_each_role_publishes_results_under_its_own_origin_only():
    results = lambda origin: subjects.results(origin, "alice.job")  # noqa: E731
    eng = lambda subject: allowed("engine-worker", "publish", subject, "n1-gpu0")  # noqa: E731
    assert eng(results("n1-gpu0"))
    assert not any(eng(results(o)) for o in ("n1-gpu1", "n1-gpu", subjects.ORIGIN_INGESTOR, subjects.ORIGIN_BUCKETER))
    assert allowed("ingestor", "publish", results(subjects.ORIGIN_INGESTOR))
    assert not allowed("ingestor", "publish", results("r0")) and not allowed("ingestor", "publish", results(subjects.ORIGIN_BUCKETER))
    assert allowed("bucketer", "publish", results(subjects.ORIGIN_BUCKETER), "n1")
    assert not allowed("bucketer", "publish", results("r0"), "n1")
    assert not any(allowed("router", "publish", results(o)) for o in ("r0", subjects.ORIGIN_INGESTOR)), "the router writes no rows"
    assert allowed("sink", "publish", results("r0")), "a resumed job's parked results go back under their origin"
    for role in ("submitter", "api"):
        assert not allowed(role, "publish", results("r0")), role


def test_keys_and_names_that_cannot_work_fail_at_start_up():
    assert pv.parse_key("") is None and pv.parse_key("00" * 16) == bytes(16)
    with pytest.raises(ValueError, match="hex"):
        pv.parse_key("not-hex")
    with pytest.raises(ValueError, match="at least 16"):
        pv.parse_key("ab" * 8)
    with pytest.raises(ValueError, match="origin"):
        EngineWorkerConfig(replica="_ingestor")
    cfg = SinkConfig(result_key="zz")
    with pytest.raises(ValueError, match="hex"):
        cfg.check_connection()


def test_cluster_config_gives_the_key_to_the_bucketer_router_and_sink_only(tmp_path, capsys):
    out = tmp_path / "fleet"
    run_config(out, "--hosts", "10.0.0.1,10.0.0.2", "--names", "a,b", "--head", "b", "--engines", "0,1", "--tenant", "alice")
    holders, keys = set(), set()
    for env in out.rglob("*.env"):
        values = env_of(env)
        if "PFX_RESULT_KEY" in values:
            holders.add(f"{env.parent.name}/{env.name}")
            keys.add(values["PFX_RESULT_KEY"])
            assert env.stat().st_mode & 0o077 == 0, f"{env} is readable by others"
    assert holders == {"a/bucketer.env", "b/bucketer.env", "b/router.env", "b/sink.env"}, holders
    assert len(keys) == 1 and pv.parse_key(keys.pop()) is not None, "one key for the fleet"
    again = out / "b" / "sink.env"
    before = env_of(again)["PFX_RESULT_KEY"]
    run_config(out, "--hosts", "10.0.0.1,10.0.0.2", "--names", "a,b", "--head", "b", "--engines", "0,1", "--tenant", "alice")
    assert env_of(again)["PFX_RESULT_KEY"] == before, "kept when the command runs again (secrets.json)"


def test_a_cluster_started_again_on_its_workdir_keeps_its_result_key(tmp_path, monkeypatch):
    """Its JetStream store may hold work and results signed with the first key: a new key
    would make the sink refuse them, and the job would never finish."""
    from prefixflow.launch import processes as launch

    monkeypatch.delenv("PFX_RESULT_KEY", raising=False)
    monkeypatch.setattr(launch, "machine_devices", lambda: launch.Devices(cores=(0, 1)))
    first, second = launch.processes(2, engine="echo"), launch.processes(2, engine="echo")
    key = lambda procs: {p.env.get("PFX_RESULT_KEY") for p in procs if p.name in ("bucketer", "router", "sink")}  # noqa: E731
    assert key(first) != key(second), "a new set makes its own key"
    launch.keep_result_key(first, tmp_path)
    assert (tmp_path / launch.RESULT_KEY_FILE).stat().st_mode & 0o777 == 0o600
    launch.keep_result_key(second, tmp_path)
    assert key(first) == key(second) and len(key(second)) == 1
    assert all("PFX_RESULT_KEY" not in p.env for p in second if p.is_engine)
