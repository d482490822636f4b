"""The ``baton`` command: ``generate`` (one prompt, locally or against a server), ``serve`` (the stack)
and ``bench``. Flags come from the config fields (baton/flags.py); the client is baton.api.client."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import fields

from baton import flags
from baton.api import InvalidRequestError, SamplingParams
from baton.api.params import Constraint
from baton.bench.cli import add_parser as add_bench_parser
from baton.config import ConfigError, EngineConfig, Limits, PoolConfig, PrefixRoutingConfig, ServeConfig, default_of

# `baton generate` writes for a person at a terminal: a longer answer than an API request's default.
GENERATE_MAX_TOKENS = 128


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field, default and help from the field."""
    for f in fields(SamplingParams):
        name = "--" + f.name.replace("_", "-")
        default = GENERATE_MAX_TOKENS if f.name == "max_tokens" else f.default
        help_ = f.metadata["help"]
        if f.name == "constraint":
            c = p.add_mutually_exclusive_group()
            c.add_argument("--json-schema", metavar="SCHEMA", help="structured output: a JSON Schema (JSON text, "
                           "or @FILE) the answer must validate against")
            c.add_argument("--json-object", action="store_true", help="structured output: any JSON object")
            c.add_argument("--regex", help="structured output: the answer fully matches this regular expression")
            c.add_argument("--choice", action="append", help="structured output: the answer is one of these "
                           "strings (repeatable)")
            c.add_argument("--grammar", metavar="GRAMMAR", help="structured output: a grammar in llguidance's Lark "
                           "syntax or GBNF (text, or @FILE)")
        elif isinstance(f.default, bool):
            p.add_argument(name, action="store_true", help=help_)
        elif f.name == "stop":
            p.add_argument(name, action="append", default=[], help=help_)
        elif f.name == "stop_token_ids":
            p.add_argument(name, action="append", type=int, default=[], help=help_)
        else:
            kind = int if f.name == "seed" else type(f.default)
            p.add_argument(name, type=kind, default=default, help=f"{help_} (default {default})")


def _text_or_file(value: str, flag: str) -> str:
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeError) as e:
            raise InvalidRequestError(flag, f"{flag}: cannot read {value[1:]}: {e}") from None
    return value


def _constraint(args: argparse.Namespace) -> Constraint | None:
    if args.json_schema is not None:
        return Constraint("json_schema", _text_or_file(args.json_schema, "--json-schema"))
    if args.json_object:
        return Constraint("json_object")
    if args.regex is not None:
        return Constraint("regex", args.regex)
    if args.choice:
        return Constraint("choice", choices=tuple(args.choice))
    if args.grammar is not None:
        return Constraint("grammar", _text_or_file(args.grammar, "--grammar"))
    return None


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{name: tuple(v) if isinstance(v := getattr(args, name), list) else v
                             for name in SamplingParams.field_names() if name != "constraint"},
                          constraint=_constraint(args))


class _Output:
    """Collects a generation's deltas; streams the text to the terminal unless printing JSON at the end."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None

    def add(self, token_ids, text: str, finish_reason: str | None) -> None:
        self.token_ids += token_ids
        self.text += text
        if not self.as_json and text:
            sys.stdout.write(text)
            sys.stdout.flush()
        if finish_reason:
            self.finish_reason = finish_reason

    def close(self, **extra: object) -> None:
        if self.as_json:
            print(json.dumps({"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
                              **extra}))
        else:
            sys.stdout.write("\n")


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
    from baton.engine.engine import LLMEngine

    params = _sampling(args)
    engine = LLMEngine(EngineConfig(**flags.from_flags(EngineConfig, args)))
    prompt_ids = engine.encode_prompt(args.prompt, chat=args.chat)
    adapter = None
    if args.lora:
        from baton.model.lora import load_adapter

        adapter = load_adapter("lora", args.lora, engine.model_config, engine.config.max_lora_rank)
    rid = engine.add_request(prompt_ids, params, adapter=adapter)
    output = _Output(args.json)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                output.add(out.token_ids, out.text, out.finish_reason)
    output.close(prompt_tokens=len(prompt_ids))
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    """The client of ``baton serve``: same flags, same output, over gRPC."""
    import grpc

    from baton.api.client import Client, generate_request

    params = _sampling(args)
    if args.chat:
        req = generate_request(messages=[{"role": "user", "content": args.prompt}], sampling=params,
                               adapter=args.lora or "")
    else:
        req = generate_request(args.prompt, sampling=params, adapter=args.lora or "")
    output = _Output(args.json)
    with Client(args.server, tls_ca=args.tls_ca, token=args.token) as client:
        try:
            for msg in client.generate(req):
                output.add(list(msg.token_ids), msg.text, msg.finish_reason)
        except grpc.RpcError as e:
            print(f"baton: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    output.close()
    return 0


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="connect with TLS, trusting this certificate or CA (the server's --tls-cert or --tls-ca)")
    p.add_argument("--token", default=None, help="bearer token for a server with --auth-tokens-file "
                                                 "(default: BATON_TOKEN)")


def _json_map(text: str | None, cast) -> dict:
    """'{"gpu_node": 1}' or 'key=value,key=value' -> dict."""
    if not text:
        return {}
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from e
    else:
        raw = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        if not raw:
            raise ValueError(f"{text!r}: want key=value[,key=value] or a JSON object")
    try:
        return {str(k): cast(v) for k, v in raw.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{text!r}: {e}") from e


def _tls(args: argparse.Namespace):
    from baton.security import TLSConfig

    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        try:
            return TLSConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    if args.tls_ca:
        raise ConfigError("--tls-ca needs --tls-cert and --tls-key")
    return None


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """``baton serve``'s flags -> ServeConfig: one path from flags to config."""
    pools = {}
    for kind in ("prefill", "decode"):
        try:
            pools[kind] = PoolConfig(**flags.from_flags(
                PoolConfig, args, max=getattr(args, f"{kind}_max"),
                resources=_json_map(getattr(args, f"{kind}_resources"), float),
                labels=_json_map(getattr(args, f"{kind}_labels"), str)))
        except ValueError as e:
            raise ConfigError(f"--{kind}-*: {e}") from e
    return ServeConfig(**flags.from_flags(
        ServeConfig, args, engine=EngineConfig(**flags.from_flags(EngineConfig, args)),
        limits=Limits(**flags.from_flags(Limits, args)),
        prefix_routing=PrefixRoutingConfig(**flags.from_flags(PrefixRoutingConfig, args)),
        prefill_pool=pools["prefill"], decode_pool=pools["decode"], tls=_tls(args),
        # This process serves and nothing else: with pinning it leaves the decode workers' cores to them.
        pin_router=getattr(args, "ServeConfig.pin_cpus")))


def _log_events() -> None:
    """What Baton's own modules log at INFO and above (pools added and removed, the prefix index lost and back)
    goes to stdout beside the startup lines, as ``baton: ...``; other libraries keep their own levels."""
    import logging

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("baton: %(message)s"))
    logger = logging.getLogger("baton")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    logger.propagate = False


def _stop_on_signals():
    """An event that SIGINT and SIGTERM set (installed now: after Ray starts, whose driver installs a SIGTERM
    handler of its own that aborts the process)."""
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _serve_until(stop, shut_down, say: bool = True) -> int:
    """Wait for ``stop``, then ``shut_down()`` (saying so), whichever way the wait ends."""
    try:
        stop.wait()
    finally:
        if say:
            print("baton: shutting down", flush=True)
        shut_down()
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from baton import reaper
    from baton.serve import Stack, ray_address

    cfg = serve_config(args)
    _log_events()
    # This process is the stack's launcher: a watcher ends what it started if it dies without stopping it.
    reaper.start()
    print(f"baton: starting {cfg.prefill} prefill and {cfg.decode} decode workers...", flush=True)
    stack = Stack(cfg).start()
    stop = _stop_on_signals()
    if stack.ray_token_file is not None:
        print(f"baton: local Ray at {ray_address()} on loopback, token authentication on (the token is in "
              f"{stack.ray_token_file}); to join it: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token "
              f"RAY_AUTH_TOKEN_PATH={stack.ray_token_file}", flush=True)
    if stack.index is not None:
        where = re.sub(r"//[^@/]*@", "//***@", stack.index.url)  # never print a password
        print(f"baton: prefix-cache index at {where}", flush=True)
    for name, address in stack.metrics_addresses.items():
        print(f"baton: metrics of {name} at http://{address}/metrics", flush=True)
    if stack.tracing is not None and stack.tracing.enabled:
        print("baton: exporting traces by OTLP", flush=True)
    if stack.pinned:
        cores = ", ".join(f"{name} on {','.join(map(str, cpus))}" for name, cpus in stack.worker_cpus.items())
        if stack.router_cpus:
            cores += f"; the router on {','.join(map(str, stack.router_cpus))}"
        print(f"baton: each worker on its own cores: {cores}", flush=True)
    if stack.gateway is not None:
        print(f"baton: OpenAI-compatible API at {stack.gateway.url}", flush=True)
    if args.verbose:
        mem = stack.memory()
        for name, report in sorted(mem["workers"].items()):
            print(f"baton: memory of {name}: {report.summary()}", flush=True)
        print(f"baton: memory of the stack on this host: {mem['processes']} processes, PSS {mem['pss'] / 2**20:.0f} "
              f"MiB (RSS {mem['rss'] / 2**20:.0f} MiB, which counts shared pages once per process)", flush=True)
    print(f"baton: stack {stack.namespace!r}; another router for it: baton router --stack-name {stack.namespace} "
          f"--address {ray_address()}", flush=True)
    print(f"baton: started in {stack.started_s:.1f} s", flush=True)
    print(f"baton: serving baton.v1.Generation on {stack.address} (Ctrl-C to stop)", flush=True)
    return _serve_until(stop, stack.stop)


def _cmd_router(args: argparse.Namespace) -> int:
    """Another router for a running stack, stateless: N of them behind one load balancer."""
    from baton.serve import RouterReplica

    cfg = ServeConfig(**flags.from_flags(ServeConfig, args), tls=_tls(args))
    replica = RouterReplica(cfg).start()
    _log_events()  # once it serves: a refusal above is one line on stderr, nothing installed
    stop = _stop_on_signals()
    spec = replica.spec
    index = re.sub(r"//[^@/]*@", "//***@", spec.index.url) if spec.index else "none"
    print(f"baton: router for stack {cfg.stack_name!r}: {replica.router.workers.count('prefill')} prefill and "
          f"{replica.router.workers.count('decode')} decode workers, prefix-cache index {index}", flush=True)
    if replica.metrics_address:
        print(f"baton: metrics of this router at http://{replica.metrics_address}/metrics", flush=True)
    if replica.gateway is not None:
        print(f"baton: OpenAI-compatible API at {replica.gateway.url}", flush=True)
    print(f"baton: serving baton.v1.Generation on {replica.address} (Ctrl-C to stop)", flush=True)
    return _serve_until(stop, replica.stop)


def _cmd_gateway(args: argparse.Namespace) -> int:
    """The HTTP gateway alone, in front of a running router: gateways scale out apart from the stack. Given
    the router's BATON_GATEWAY_KEY, it names each HTTP client for the router's per-client limits."""
    from baton.security import shared_gateway_key
    from baton.services.gateway.server import Gateway

    settings = flags.from_flags(ServeConfig, args)  # the same units and "off" value as baton serve's
    if settings["http_port"] is None:
        raise ConfigError("baton gateway needs an --http-port")
    _log_events()
    gateway = Gateway(args.router, settings["host"], settings["http_port"], default_of(Limits, "max_message_bytes"),
                      _tls(args), shared_gateway_key())
    stop = _stop_on_signals()
    gateway.start()
    print(f"baton: OpenAI-compatible API at {gateway.url} for the router at {args.router} "
          "(Ctrl-C to stop)", flush=True)
    return _serve_until(stop, gateway.stop, say=False)


def _add_tls_flags(p: argparse.ArgumentParser, cert: str, ca: str, server_name: str) -> None:
    p.add_argument("--tls-cert", default=None, metavar="PEM", help=cert)
    p.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help=ca)
    p.add_argument("--tls-server-name", default=None, help=server_name)


def _add_serve_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--verbose", action="store_true",
                   help="print each worker's memory by part (weights, KV pool, runtime) and the stack's total at start")
    flags.add_flags(s, EngineConfig)
    flags.add_flags(s, ServeConfig)
    flags.add_flags(s, Limits)
    flags.add_flags(s, PrefixRoutingConfig)
    _add_tls_flags(s, "TLS certificate of every gRPC server and of the HTTPS API",
                   "CA for mutual TLS between router and workers (workers accept only certificates it signed)",
                   "name the workers' certificate carries, when it is not their address")
    for kind in ("prefill", "decode"):  # per pool; the scaling thresholds below apply to both
        s.add_argument(f"--{kind}-max", type=int, default=default_of(PoolConfig, "max"),
                       help=f"grow the {kind} pool up to this many workers under load (default: no scaling)")
        s.add_argument(f"--{kind}-resources", default=None, metavar="MAP",
                       help=f"Ray resources each {kind} worker needs, which places it: key=value,... or JSON "
                            f"(e.g. {kind}_node=1)")
        s.add_argument(f"--{kind}-labels", default=None, metavar="MAP",
                       help=f"node labels a {kind} worker must run on: key=value,...")
    flags.add_flags(s, PoolConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt and stream it to the terminal")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--lora", default=None, metavar="PATH_OR_NAME",
                   help="run under a LoRA adapter: a PEFT folder locally; with --server, an adapter's name")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object with token_ids, text and finish_reason instead of streaming")
    g.add_argument("--server", metavar="HOST:PORT", default=None,
                   help="send the request to a running `baton serve` instead of loading the model here")
    _add_client_flags(g)
    flags.add_flags(g, EngineConfig, skip=tuple(f.name for f in flags.flag_fields(EngineConfig)
                                                if f.name not in _GENERATE_ENGINE_FLAGS))
    _add_sampling_flags(g)
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser("serve", help="run the disaggregated stack: router, prefill and decode workers on Ray")
    _add_serve_flags(s)
    s.set_defaults(func=_cmd_serve)

    r = sub.add_parser("router", help="start one more router for a running stack (router replicas)")
    _add_tls_flags(r, "TLS certificate of this router's gRPC server (and of its HTTPS API)",
                   "CA for mutual TLS with the workers (the stack's)",
                   "name the workers' certificate carries, when it is not their address")
    flags.add_flags(r, ServeConfig, skip=tuple(f.name for f in flags.flag_fields(ServeConfig)
                                               if f.name not in _ROUTER_FLAGS))
    r.set_defaults(func=_cmd_router)

    gw = sub.add_parser("gateway", help="serve the OpenAI-compatible HTTP API in front of a running router")
    gw.add_argument("--router", required=True, metavar="HOST:PORT", help="the router's gRPC address")
    _add_tls_flags(gw, "serve HTTPS with this certificate and reach the router over TLS",
                   "CA that signed the router's certificate (default: trust --tls-cert itself)",
                   "name the router's certificate carries, when it is not its address")
    flags.add_flags(gw, ServeConfig, skip=tuple(f.name for f in flags.flag_fields(ServeConfig)
                                                if f.name not in ("host", "http_port")))
    gw.set_defaults(func=_cmd_gateway)

    add_bench_parser(sub)
    return parser


# `baton router`: where it serves and which stack it joins; the rest (limits, index, adapters) is the stack's.
_ROUTER_FLAGS = ("host", "port", "address", "allow_unauthenticated_ray", "stack_name", "otlp_endpoint",
                 "metrics_port", "http_port", "auth_tokens_file")

# `baton generate` runs one prompt: the model's flags, not the batching ones.
_GENERATE_ENGINE_FLAGS = ("model", "dtype", "device", "kv_cache_memory", "kv_dtype", "weights", "speculative",
                          "spec_tokens", "spec_ngram_min", "spec_ngram_max", "spec_draft_model")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Bad input is a one-line error and exit status 2, never a traceback (ModelLoadError is a ValueError).
    try:
        return args.func(args)
    except (InvalidRequestError, ConfigError, ValueError, FileNotFoundError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
