"""The command line is built per command (`prefixflow.cli.main.build_parser`): a service
process parses only its own part, so it does not import the API's web framework, the
simulator or the local launcher; the full parser still has every command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefixflow.cli.main import COMMANDS, SERVED, build_parser, parse_args

pytestmark = pytest.mark.heavy

NOT_FOR_A_SERVICE = ("fastapi", "prefixflow.batchapi.service", "prefixflow.launch.local_cluster",
                     "prefixflow.sim.commands", "prefixflow.datagen.dataset", "prefixflow.bench.commands",
                     "prefixflow.client.submit", "prefixflow.report.job_report")


def choices(parser) -> list[str]:
    [sub] = [a for a in parser._actions if a.dest == "command"]
    return list(sub.choices)


def test_the_full_parser_has_every_command_in_order():
    assert choices(build_parser()) == list(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_alone_parses_as_in_the_full_parser(command):
    alone_choices = choices(build_parser(command))
    assert command in alone_choices and len(alone_choices) <= 3  # status, jobs and top come together
    full, alone = build_parser(), build_parser(command)
    sub_full = full._subparsers._group_actions[0].choices[command]
    sub_alone = alone._subparsers._group_actions[0].choices[command]
    assert sub_alone.format_help() == sub_full.format_help()


@pytest.mark.parametrize("service", SERVED)
def test_serve_parses_each_service(service):
    args = parse_args(["serve", service, "--help"][:2])
    assert args.command == "serve" and args.service == service


@pytest.mark.parametrize("service", ["ingestor", "bucketer", "router", "sink", "engine-worker"])
def test_a_service_process_imports_only_its_own_modules(service):
    code = (f"import sys, json; from prefixflow.cli.main import parse_args; parse_args(['serve', {service!r}]); "
            "import prefixflow.services.registry as r, importlib; "
            f"importlib.import_module(r._CLASSES[{service!r}][0]); "
            f"print(json.dumps([m for m in {list(NOT_FOR_A_SERVICE)!r} if m in sys.modules]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(res.stdout) == []


def test_serve_nats_imports_nothing_of_the_services():
    """`serve nats` only parses its flags and execs nats-server (every local cluster and
    every restart starts one): none of the services' modules, NATS client, logging or Arrow."""
    code = ("import sys, json; from prefixflow.cli.main import parse_args; parse_args(['serve', 'nats']); "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('nats', 'structlog', 'pyarrow', 'aiohttp') "
            "or (m.startswith('prefixflow.services.') and m != 'prefixflow.services.registry'))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(res.stdout) == []
