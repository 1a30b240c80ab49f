"""prefixflow.shared.process.config: flags > PFX_* environment > defaults, typed and validated."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from prefixflow.shared.process.config import (
    BucketerConfig,
    CommonConfig,
    EngineWorkerConfig,
    IngestorConfig,
    RouterConfig,
    SinkConfig,
    add_arguments,
    load,
)

pytestmark = pytest.mark.unit

ALL = [CommonConfig, IngestorConfig, BucketerConfig, RouterConfig, EngineWorkerConfig, SinkConfig]


def parse(cls, argv, environ=None):
    parser = argparse.ArgumentParser(prog="svc")
    add_arguments(parser, cls)
    return load(cls, parser.parse_args(argv), environ or {})


@pytest.mark.parametrize("cls", ALL)
def test_defaults(cls):
    cfg = parse(cls, [])
    assert cfg == cls()
    # no arguments and an empty environment: the same
    assert load(cls, None, {}) == cls()


def test_flag_beats_env_beats_default():
    default = BucketerConfig().max_wait
    assert default not in (0.5, 3.25)
    assert parse(BucketerConfig, []).max_wait == default
    assert parse(BucketerConfig, [], {"PFX_MAX_WAIT": "0.5"}).max_wait == 0.5
    assert parse(BucketerConfig, ["--max-wait", "3.25"], {"PFX_MAX_WAIT": "0.5"}).max_wait == 3.25
    cfg = parse(RouterConfig, ["--policy", "round-robin"], {"PFX_POLICY": "least-loaded", "PFX_HISTORY": "9"})
    assert cfg.policy == "round-robin" and cfg.history == 9
    cfg = parse(CommonConfig, [], {"PFX_NATS_URL": "nats://a:1,nats://b:2"})
    assert cfg.nats_url == "nats://a:1,nats://b:2"


def test_env_values_are_converted():
    cfg = parse(
        EngineWorkerConfig,
        [],
        {"PFX_WINDOW": "7", "PFX_RESULT_LINGER": "0.5", "PFX_ENFORCE_EAGER": "false", "PFX_KV_CACHE_BLOCKS": "0"},
    )
    assert cfg.window == 7 and type(cfg.window) is int
    assert cfg.result_linger == 0.5 and type(cfg.result_linger) is float
    assert cfg.enforce_eager is False
    assert cfg.kv_cache_blocks == 0
    assert parse(EngineWorkerConfig, [], {"PFX_ENFORCE_EAGER": "true"}).enforce_eager is True
    assert parse(EngineWorkerConfig, [], {"PFX_ENFORCE_EAGER": "0"}).enforce_eager is False
    assert parse(EngineWorkerConfig, [], {"PFX_ENFORCE_EAGER": "1"}).enforce_eager is True
    # an integer is acceptable where a float is expected
    assert parse(SinkConfig, [], {"PFX_FLUSH_SECONDS": "2"}).flush_seconds == 2.0


def test_flag_values_are_converted():
    cfg = parse(EngineWorkerConfig, ["--window", "12", "--echo-delay", "0.01", "--no-enforce-eager", "--engine", "echo"])
    assert (cfg.window, cfg.echo_delay, cfg.enforce_eager, cfg.engine) == (12, 0.01, False, "echo")
    # a False flag overrides a true environment value (False is not "unset")
    cfg = parse(EngineWorkerConfig, ["--no-enforce-eager"], {"PFX_ENFORCE_EAGER": "true"})
    assert cfg.enforce_eager is False
    cfg = parse(EngineWorkerConfig, ["--enforce-eager"], {"PFX_ENFORCE_EAGER": "false"})
    assert cfg.enforce_eager is True


def test_unrelated_env_ignored():
    cfg = parse(SinkConfig, [], {"PFX_WINDOW": "-5", "WINDOW": "x", "pfx_flush_rows": "3"})
    assert cfg == SinkConfig()


@pytest.mark.parametrize(
    "cls,argv,env",
    [
        (EngineWorkerConfig, ["--window=-1"], {}),
        (EngineWorkerConfig, ["--window", "0"], {}),
        (EngineWorkerConfig, ["--window", "1.5"], {}),
        (EngineWorkerConfig, ["--window", "many"], {}),
        (EngineWorkerConfig, [], {"PFX_WINDOW": "-1"}),
        (EngineWorkerConfig, [], {"PFX_WINDOW": ""}),
        (EngineWorkerConfig, [], {"PFX_ENFORCE_EAGER": "maybe"}),
        (EngineWorkerConfig, [], {"PFX_ENGINE": "tgi"}),
        (EngineWorkerConfig, ["--engine", "tgi"], {}),
        (EngineWorkerConfig, ["--kv-cache-blocks=-1"], {}),
        (RouterConfig, ["--policy", "random"], {}),
        (RouterConfig, [], {"PFX_POLICY": "random"}),
        (RouterConfig, ["--load-slack-tokens=-1"], {}),
        (BucketerConfig, ["--threshold", "1.5"], {}),
        (BucketerConfig, [], {"PFX_MAX_WAIT": "0"}),
        (CommonConfig, ["--log-level", "trace"], {}),
        (CommonConfig, [], {"PFX_DRAIN_TIMEOUT": "soon"}),
        (SinkConfig, ["--nonexistent", "1"], {}),
        (BucketerConfig, ["--node", "a.b"], {}),
        (BucketerConfig, [], {"PFX_NODE": "has space"}),
        (BucketerConfig, ["--node", ""], {}),
        (EngineWorkerConfig, ["--replica", "r*"], {}),
        (EngineWorkerConfig, [], {"PFX_REPLICA": "x" * 65}),
        (EngineWorkerConfig, ["--gpus", "a"], {}),
        (EngineWorkerConfig, ["--gpus", "3-1"], {}),
        (EngineWorkerConfig, ["--gpus", "1,1"], {}),
        (EngineWorkerConfig, ["--gpus", "-1"], {}),
        (EngineWorkerConfig, ["--gpus", "100", "--metrics-port-base", "65500"], {}),
        (EngineWorkerConfig, ["--max-model-len=-1"], {}),
    ],
)
def test_invalid_values_exit(cls, argv, env, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(cls, argv, env)
    assert exc.value.code != 0
    message = str(exc.value) + capsys.readouterr().err
    assert message.strip()


def test_validation_message_names_field():
    with pytest.raises(SystemExit) as exc:
        parse(EngineWorkerConfig, [], {"PFX_WINDOW": "-1"})
    assert "window" in str(exc.value) and "invalid configuration" in str(exc.value)
    assert exc.value.code == 2, "a bad configuration is a usage error (docs/outcomes.md)"


def test_valid_names_accepted():
    assert parse(BucketerConfig, ["--node", "node-1_B"]).node == "node-1_B"
    assert parse(EngineWorkerConfig, [], {"PFX_REPLICA": "r" * 64}).replica == "r" * 64


def test_boundary_values_accepted():
    assert parse(BucketerConfig, ["--threshold", "0"]).threshold == 0.0
    assert parse(BucketerConfig, ["--threshold", "1"]).threshold == 1.0
    assert parse(RouterConfig, ["--load-slack-tokens", "0"]).load_slack_tokens == 0
    assert parse(EngineWorkerConfig, ["--window", "1"]).window == 1


@pytest.mark.parametrize("cls", ALL)
def test_every_field_has_a_flag(cls):
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in msgspec.structs.fields(cls)} <= dests
    ns = parser.parse_args([])
    assert all(getattr(ns, f.name) is None for f in msgspec.structs.fields(cls))


def test_help_mentions_description_and_env(capsys):
    parser = argparse.ArgumentParser(prog="svc")
    add_arguments(parser, BucketerConfig)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert "--max-wait" in text
    assert "longest a prompt waits in the buffer, seconds" in text
    assert "PFX_MAX_WAIT" in text
    assert "--min-bucket" in text and "PFX_MIN_BUCKET" in text
    assert "released buckets this large go out keyed by their prefix" in text
    for f in msgspec.structs.fields(BucketerConfig):
        assert "PFX_" + f.name.upper() in text


@pytest.mark.parametrize("cls", ALL)
def test_help_renders_for_every_config(cls):
    parser = argparse.ArgumentParser(prog="svc")
    add_arguments(parser, cls)
    text = " ".join(parser.format_help().split())
    for f in msgspec.structs.fields(cls):
        assert "--" + f.name.replace("_", "-") in text
        assert "PFX_" + f.name.upper() in text
