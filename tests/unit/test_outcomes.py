"""One table of outcomes (issue 39, item 7): docs/outcomes.md against the code, both ways.

- The page's tables (exit codes, codes by command, job states, batch states, HTTP
  statuses) hold exactly what `prefixflow/shared/outcomes.py` names, and the commands
  table covers every command `prefixflow --help` lists (and no other).
- No module exits with a code that is not an `Exit` member: an AST scan of every
  `sys.exit`, `SystemExit`, `os._exit`, `CommandError`, of every function that returns
  an `Exit`, of the batch API's error statuses and batch state literals.
- The documented code comes out of the real command: a few cheap cases through the CLI
  (no NATS, nothing started), in one process, and one as a shell sees it.
"""

from __future__ import annotations

import argparse
import ast
import functools
import itertools
import json
import re
import subprocess
import sys
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace

import pytest

from prefixflow.batchapi import batches
from prefixflow.client.status import JobView
from prefixflow.shared.outcomes import API_ERRORS, FINAL, BatchState, CommandError, Exit, JobState, interrupted, reported
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "outcomes.md"
PACKAGE = REPO / "prefixflow"
NOT_SCANNED = ("bench/peers/",)
"""Run by the peers' own Python (their virtualenv), which has no prefixflow to import."""


def table(heading: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table under `## heading`, as {header: cell}."""
    lines = DOC.read_text().splitlines()
    start = lines.index(f"## {heading}")
    rows: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    header, _rule, *body = rows
    assert all(len(r) == len(header) for r in body), f"a row of {heading!r} has another number of cells"
    return [dict(zip(header, r)) for r in body]


def code_text(code: Exit) -> str:
    return "128+N" if code is Exit.INTERRUPTED else str(int(code))


def unquote(cell: str) -> str:
    return cell.strip("`")


# --- (a) the page against the code -------------------------------------------------------


def test_the_exit_code_table_is_the_exit_enum():
    rows = table("Exit codes")
    assert [(r["code"], unquote(r["name"])) for r in rows] == [(code_text(c), c.name) for c in Exit]
    assert interrupted(15) == 143 and interrupted(2) == 130


def commands_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_commands_table_covers_every_command_of_the_cli_and_only_codes_it_names():
    from prefixflow.cli.main import build_parser

    rows = table("Exit codes by command")
    named = {code_text(c) for c in Exit}
    for header in rows[0]:
        assert header in ("command", "other") or header in named, f"column {header!r} is no exit code"
    documented: list[list[str]] = []
    for row in rows:
        words = unquote(row["command"]).split()
        assert words[0] == "prefixflow", row["command"]
        documented.append([w for w in words[1:] if re.fullmatch(r"[a-z][a-z-]*", w)])
        for code in re.findall(r"\b(\d+(?:\+N)?)\b", row["other"]):
            assert code in named, f"{row['command']}: code {code} is not in the Exit enum"
    commands = commands_of(build_parser())
    assert sorted({d[0] for d in documented}) == sorted(commands), "the page lists exactly the commands of --help"
    cluster = {d[1] for d in documented if d[0] == "cluster"}
    assert cluster == set(commands_of(commands["cluster"])), "and every `cluster` subcommand"
    services = set(commands_of(commands["serve"]))
    other = next(r["other"] for r in rows if unquote(r["command"]).startswith("prefixflow serve"))
    for service in re.findall(r"`serve ([a-z-]+)", other):
        assert service in services, f"`serve {service}` is no service"


def test_the_job_state_table_is_the_job_state_enum():
    rows = table("Job states")
    assert [unquote(r["state"]) for r in rows] == [s.value for s in JobState]
    assert {unquote(r["state"]) for r in rows if r["final"] == "yes"} == {s.value for s in FINAL}
    assert {r["final"] for r in rows} == {"yes", "no"}


def test_every_job_status_maps_to_one_documented_state_and_every_state_is_reached():
    """`status`'s state for every combination of the status flags (and a cancelled spec,
    and no status at all): always a JobState; each JobState comes out of some status."""
    seen: set[JobState] = set()
    spec = m.JobSpec("j", "/o", total=3, created_at=1.0)
    cancelled_spec = m.JobSpec("j", "/o", total=3, created_at=1.0, cancelled_at=2.0)
    for done, failed, cancelled, paused, expired, spec_ in itertools.product(
            (False, True), (False, True), (False, True), (None, "disk full"), (False, True), (None, spec, cancelled_spec)):
        status = m.JobStatus("j", rows=1, total=3, done=done, failed=failed, cancelled=cancelled, paused=paused,
                             summary={"expired": expired, "wall_seconds": 1.0})
        view = JobView.of("j", status, spec_)
        assert isinstance(view.state, JobState), view
        assert json.loads(json.dumps(view.as_dict()))["state"] == view.state.value
        seen.add(view.state)
    for spec_ in (spec, cancelled_spec):
        seen.add(JobView.of("j", None, spec_).state)
    assert seen == set(JobState)
    ended = m.JobStatus("j", rows=1, done=True, cancelled=True, summary={"expired": True})
    assert JobView.of("j", ended, None).state is JobState.EXPIRED
    assert JobView.of("j", m.JobStatus("j", rows=1, done=True, cancelled=True, summary={"expired": False}), None).state \
        is JobState.CANCELLED


def test_the_batch_state_table_is_the_batch_state_enum():
    rows = table("Batch states (OpenAI Batch API)")
    assert {unquote(r["status"]) for r in rows} == {s.value for s in BatchState}
    assert len(rows) == len(BatchState)
    assert {unquote(r["status"]) for r in rows if r["final"] == "yes"} == set(batches.TERMINAL)


def test_the_http_table_is_the_api_errors():
    rows = table("HTTP statuses of the batch API")
    assert {(int(r["status"]), unquote(r["type"])) for r in rows} == {(int(s), t) for s, t in API_ERRORS.items()}


def test_the_readme_points_to_the_page():
    readme = (REPO / "README.md").read_text()
    assert "docs/outcomes.md" in readme
    assert "(docs/outcomes.md)" in readme or "[docs/outcomes.md]" in readme or "`docs/outcomes.md`" in readme


# --- (b) no exit code that the table does not name -----------------------------------


MENTIONS = re.compile(r"exit|EXIT|EX_|CommandError|ApiError|status")
"""A module that has none of these words has nothing the scans look for (it is not parsed)."""


@functools.cache
def modules() -> list[tuple[str, ast.Module]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel, text = path.relative_to(PACKAGE).as_posix(), path.read_text()
        if not rel.startswith(NOT_SCANNED) and MENTIONS.search(text):
            found.append((rel, ast.parse(text, filename=str(path))))
    return found


def callee(node: ast.Call) -> str:
    f = node.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return f"{f.value.id}.{f.attr}"
    return f.id if isinstance(f, ast.Name) else ""


def named_exit(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Exit" \
        and node.attr in Exit.__members__


def literal(node: ast.expr) -> bool:
    """An exit code written out: a number, or a message (Python exits 1 for it, unnamed)."""
    return isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)) and not (
        isinstance(node, ast.Constant) and node.value is None)


def exit_problems(rel: str, tree: ast.Module) -> list[str]:
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = callee(node)
            if name in ("sys.exit", "SystemExit", "os._exit", "exit") and node.args and literal(node.args[0]):
                problems.append(f"{rel}:{node.lineno}: {name}({ast.unparse(node.args[0])[:60]}): "
                                "name its code (an Exit member, CommandError or usage_error)")
            if name == "CommandError" and (len(node.args) < 2 or not named_exit(node.args[1])):
                problems.append(f"{rel}:{node.lineno}: CommandError without an Exit member as its code")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None \
                and ast.unparse(node.returns) == "Exit":
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and not (ret.value is not None and named_exit(ret.value)):
                    problems.append(f"{rel}:{ret.lineno}: {node.name} -> Exit returns {ast.unparse(ret.value) if ret.value else None}")
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int):
            for target in node.targets:
                if isinstance(target, ast.Name) and re.search(r"(^|_)(EXIT|EX)(_|$)|EXIT_CODE", target.id):
                    problems.append(f"{rel}:{node.lineno}: {target.id} = {node.value.value}: an Exit member instead")
    return problems


def test_no_module_exits_with_a_code_the_table_does_not_name():
    problems = [p for rel, tree in modules() for p in exit_problems(rel, tree)]
    assert problems == []


def test_the_scan_finds_what_it_is_for():
    """The scan above is not vacuous: each kind of unnamed exit is caught."""
    bad = ast.parse("import sys\nsys.exit(2)\nraise SystemExit('why')\nos._exit(3)\nCommandError('x', 2)\n"
                    "EX_TEMPFAIL = 75\ndef main() -> Exit:\n    return 2\n")
    assert len(exit_problems("x.py", bad)) == 6
    good = ast.parse("sys.exit(Exit.USAGE)\nraise SystemExit(asyncio.run(main()))\nsys.exit(code)\n"
                     "raise CommandError('x', Exit.PAUSED)\nX_EXIT = Exit.FAILED\ndef main() -> Exit:\n    return Exit.OK\n")
    assert exit_problems("y.py", good) == []


def test_the_batch_api_answers_only_documented_statuses_and_states():
    states: set[str] = set()
    for rel, tree in modules():
        if not rel.startswith("batchapi/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and callee(node) == "ApiError":
                arg = node.args[0]  # HTTPStatus.X, or a variable (ApiError looks its type up in API_ERRORS)
                assert isinstance(arg, ast.Name) or ast.unparse(arg).startswith("HTTPStatus."), f"{rel}:{node.lineno}"
                if isinstance(arg, ast.Attribute):
                    assert HTTPStatus[arg.attr] in API_ERRORS, f"{rel}:{node.lineno}: {arg.attr} is not documented"
            if isinstance(node, ast.Call) and callee(node) == "enter" and len(node.args) > 1:
                states |= {node.args[1].value} if isinstance(node.args[1], ast.Constant) else set()
            if isinstance(node, ast.Dict):  # a Batch object written out (a file's has a status of its own)
                fields = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
                if isinstance(fields.get("object"), ast.Constant) and fields["object"].value == "batch" \
                        and isinstance(fields.get("status"), ast.Constant):
                    states.add(fields["status"].value)
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Subscript) \
                    and ast.unparse(node.left.slice) == "'status'":
                for right in node.comparators:
                    parts = right.elts if isinstance(right, (ast.Tuple, ast.Set, ast.List)) else [right]
                    states |= {p.value for p in parts if isinstance(p, ast.Constant)}
    from prefixflow.batchapi.lifecycle import FINAL_OF

    states |= set(FINAL_OF.values())
    assert states and states <= {s.value for s in BatchState}, states - {s.value for s in BatchState}


def test_every_error_of_the_batch_api_has_openais_shape_and_a_documented_status():
    """FastAPI's own replies (a body that does not validate: 422 {"detail"}; no such path or
    method) and an unexpected error become OpenAI-shaped errors of the documented statuses."""
    from fastapi.testclient import TestClient

    from prefixflow.batchapi.app import make_app
    from prefixflow.shared.api_keys import KeyRing

    cfg = SimpleNamespace(task="generate", model="m", max_file_bytes=10)
    client = TestClient(make_app(store=None, runner=None, keys=KeyRing("", ""), cfg=cfg, js=None, nc=None),
                        raise_server_exceptions=False)
    cases = [
        (client.post("/v1/batches", json={"endpoint": "/v1/chat/completions"}), HTTPStatus.BAD_REQUEST, "input_file_id"),
        (client.post("/v1/batches", json={"input_file_id": "f", "endpoint": "/v1/x"}), HTTPStatus.BAD_REQUEST,
         "endpoint '/v1/x' is not served"),
        (client.get("/v1/nothing"), HTTPStatus.NOT_FOUND, "Not Found"),
        (client.put("/v1/batches"), HTTPStatus.METHOD_NOT_ALLOWED, "Method Not Allowed"),
        (client.get("/v1/batches"), HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (AttributeError)"),  # no store
    ]
    for res, status, words in cases:
        body = res.json()
        assert res.status_code == status and set(body) == {"error"}, (res.status_code, body)
        assert set(body["error"]) == {"message", "type", "param", "code"} and words in body["error"]["message"], body
        assert body["error"]["type"] == API_ERRORS[status]
    assert "NoneType" not in cases[-1][0].json()["error"]["message"], "no internals in a 500"


def test_a_command_error_prints_its_message_and_exits_with_its_code(capsys):
    def refuse() -> None:
        raise CommandError("job j paused: disk full", Exit.PAUSED)

    with pytest.raises(SystemExit) as exc:
        reported(refuse)
    assert exc.value.code == Exit.PAUSED == 75
    assert capsys.readouterr().err == "error: job j paused: disk full\n"
    assert str(CommandError("why", Exit.USAGE)) == "why", "pytest.raises(SystemExit, match=...) sees the message"


# --- (c) the documented code comes out of the real command -----------------------------

DRIVER = """
import contextlib, io, json, sys
from prefixflow.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixflow.cli.main", *argv], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def test_the_documented_codes_come_out_of_the_cli(tmp_path):
    """Cheap cases that need no cluster, through `prefixflow.cli.main.main` in one
    process (each would start nothing: they are refused before connecting)."""
    good = tmp_path / "in.jsonl"
    good.write_text('{"prompt": "x"}\n')
    (tmp_path / "in.txt").write_text("x\n")
    (tmp_path / "empty").mkdir()
    out = str(tmp_path / "out")
    cases = [
        (["submit", str(good), "--out", out, "--job", "bad:id", "--nats", "nats://127.0.0.1:1"], Exit.USAGE,
         "invalid job id 'bad:id'"),
        (["cancel", "bad:id", "--nats", "nats://127.0.0.1:1"], Exit.USAGE, "invalid job id 'bad:id'"),
        (["status", "bad:id", "--nats", "nats://127.0.0.1:1"], Exit.USAGE, "invalid job id 'bad:id'"),
        (["run", str(tmp_path / "missing.parquet"), "--out", out, "--engine", "echo"], Exit.USAGE, "no such file"),
        (["run", str(tmp_path / "in.txt"), "--out", out, "--engine", "echo"], Exit.USAGE, "want a Parquet (.parquet), JSON lines (.jsonl) or CSV"),
        (["submit", str(tmp_path / "missing.jsonl"), "--out", out, "--job", "j", "--nats", "nats://127.0.0.1:1"],
         Exit.USAGE, "no such file"),
        (["submit", str(good), "--out", out, "--job", "j", "--chat-template-kwargs", "[1]"], Exit.USAGE,
         "--chat-template-kwargs wants a JSON object"),
        (["status", "j", "--nats", "nats://127.0.0.1:1", "--connect-timeout", "0.2"], Exit.FAILED, "cannot reach NATS"),
        (["report", str(tmp_path / "empty")], Exit.USAGE, "no part-*.parquet"),
        (["submit", str(good), "--out", out, "--no-such-flag"], Exit.USAGE, "unrecognized arguments"),
    ]
    res = subprocess.run([sys.executable, "-c", DRIVER, json.dumps([argv for argv, _, _ in cases])],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.splitlines()[-1])
    for (argv, code, words), (code_got, err) in zip(cases, got):
        assert code_got == code and words in err, (argv, code_got, err)
        assert "Traceback" not in err, err
    assert got[0] == got[1] == got[2], "submit, cancel and status refuse an invalid id alike (they once differed)"
    assert not Path(out).exists(), "nothing ran: no output directory"


def test_a_shell_sees_the_code(tmp_path):
    """As a real process (the interpreter's exit status, not a caught SystemExit)."""
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "x"}\n')
    res = run_cli("submit", str(data), "--out", str(tmp_path / "out"), "--job", "bad:id", "--nats", "nats://127.0.0.1:1")
    assert res.returncode == Exit.USAGE == 2, res
    assert res.stderr == "error: invalid job id 'bad:id': it contains ':'; use letters, digits, '-' and '_' (a job id " \
        "is letters, digits, '-' and '_', at most 64, after its tenant and a '.' on a fleet with tenants)\n", res.stderr
