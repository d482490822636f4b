"""One config tree: every flag of ``baton serve`` and ``baton generate`` takes its default from a config
field, and the flags with no config field are named here, so a new one must be placed."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from baton import flags
from baton.api import SamplingParams
from baton.cli import GENERATE_MAX_TOKENS, build_parser, serve_config
from baton.config import ConfigError, EngineConfig, Limits, PoolConfig, PrefixRoutingConfig, ServeConfig, default_of
from baton.engine.scheduler import SchedulerConfig

CONFIGS = {c.__name__: c for c in (EngineConfig, ServeConfig, Limits, PrefixRoutingConfig, PoolConfig)}
# Flags that are not one config field: what they set instead.
NOT_FIELDS = {
    "serve": {"tls_cert", "tls_key", "tls_ca", "tls_server_name",  # -> ServeConfig.tls (a TLSConfig)
              "prefill_max", "prefill_resources", "prefill_labels",  # -> ServeConfig.prefill_pool
              "decode_max", "decode_resources", "decode_labels",  # -> ServeConfig.decode_pool
              "verbose"},  # what the launcher prints, not how the stack runs
    "generate": {"prompt", "chat", "json", "server", "tls_ca", "token", "lora",  # the request and the client
                 "json_schema", "json_object", "regex", "choice", "grammar"},  # -> SamplingParams.constraint
    "gateway": {"router", "tls_cert", "tls_key", "tls_ca", "tls_server_name"},  # the router it fronts; its TLS
}


def _subparser(name: str):
    parser = build_parser()
    return next(a for a in parser._subparsers._group_actions if a.choices).choices[name]


def _field(dest: str):
    cls_name, _, field_name = dest.partition(".")
    cls = CONFIGS[cls_name]
    return cls, next(f for f in dataclasses.fields(cls) if f.name == field_name)


@pytest.mark.parametrize("command", ["serve", "generate", "gateway"])
def test_every_flag_default_is_the_config_default(command):
    seen = 0
    for action in _subparser(command)._actions:
        if action.dest == "help":
            continue
        if "." in action.dest:
            cls, f = _field(action.dest)
            if isinstance(f.default, bool):
                assert action.default is f.default, action.option_strings
            elif isinstance(f.default, tuple):  # a flag given once per value; none given: the default
                assert action.default is None and isinstance(action, argparse._AppendAction), action.option_strings
            elif f.default is None:
                assert action.default == f.metadata["off"], action.option_strings
            else:
                assert action.default * f.metadata["scale"] == f.default, action.option_strings
            seen += 1
        elif action.dest in SamplingParams.field_names():
            f = next(f for f in dataclasses.fields(SamplingParams) if f.name == action.dest)
            want = GENERATE_MAX_TOKENS if f.name == "max_tokens" else f.default
            assert action.default in (want, list(want) if isinstance(want, tuple) else want), action.dest
            seen += 1
        elif action.dest.endswith("_max"):
            assert action.default == default_of(PoolConfig, "max")
        else:
            assert action.dest in NOT_FIELDS[command], f"{action.option_strings}: map it to a config field"
    assert seen >= {"serve": 30, "generate": 15, "gateway": 2}[command]


def test_serve_without_flags_is_the_default_config():
    cfg = serve_config(build_parser().parse_args(["serve"]))
    # The serve process pins itself off the decode workers' cores: a fact of that process, not a default.
    assert dataclasses.replace(cfg, pin_router=False) == ServeConfig()
    assert cfg.engine == EngineConfig()


def test_flags_reach_the_config_in_its_units():
    cfg = serve_config(build_parser().parse_args(
        ["serve", "--kv-cache-memory", "0.5", "--admission-wait-ms", "5", "--max-message-mib", "2", "--metrics-port",
         "-1", "--no-prefix-cache", "--max-batch", "8", "--prefill-max", "3", "--scale-up-load", "2",
         "--prefill-resources", "prefill_node=1"]))
    assert cfg.engine.kv_cache_memory == 1 << 29 and cfg.admission_wait == pytest.approx(0.005)
    assert cfg.limits.max_message_bytes == 2 << 20 and cfg.metrics_port is None
    assert not cfg.engine.enable_prefix_caching and cfg.engine.max_num_seqs == 8
    assert cfg.prefill_pool == PoolConfig(max=3, scale_up_load=2.0, resources={"prefill_node": 1.0})
    assert cfg.decode_pool.scale_up_load == 2.0 and cfg.decode_pool.max is None


def test_scheduler_defaults_are_the_engine_defaults():
    s, e = SchedulerConfig(max_model_len=100), EngineConfig()
    for name in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill",
                 "prefill_chunk", "prefill_order"):
        assert getattr(s, name) == getattr(e, name), name


@pytest.mark.parametrize("make", [
    lambda: EngineConfig(prefill_order="random"), lambda: EngineConfig(weights="q3"),
    lambda: Limits(max_in_flight=0), lambda: Limits(default_max_tokens=10, max_output_tokens=5),
    lambda: PoolConfig(max=0), lambda: PrefixRoutingConfig(load_weight=-1), lambda: ServeConfig(prefill=0),
    lambda: SchedulerConfig(max_model_len=0),
])
def test_every_bad_setting_is_a_config_error(make):
    with pytest.raises(ConfigError):
        make()


def test_every_flag_field_has_help():
    for cls in CONFIGS.values():
        for f in flags.flag_fields(cls):
            assert f.metadata["help"], f"{cls.__name__}.{f.name} has a flag but no help"
