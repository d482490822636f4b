"""``baton serve``: the disaggregated stack on Ray (prefill workers, decode workers, the router).

The prefix-cache index lives in Redis: the URL from the config (``--redis-url``), else
``BATON_REDIS_URL``, else a private ``redis-server`` on a free loopback port when the binary is
installed, else an in-memory index (a Ray actor) with a warning. ``redis_url="memory"`` asks for the
in-memory index.

A local Ray that the stack starts itself (no ``--address``) is private to this host and this user: every
Ray server listens on loopback, and Ray's token authentication is on with a token made for this process, in
a file only its user can read (``private_ray_environment``).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import ray

from baton import reaper
from baton.api.adapters import LoraError, check_folder
from baton.config import ConfigError, ServeConfig, check_redis_url
from baton.engine.weights import config_json
from baton.loader import load_tokenizer
from baton.memory import process_tree_memory
from baton.metrics import serve_metrics
from baton.security import Tokens, gateway_key
from baton.services.autoscaler import Autoscaler
from baton.services.cores import CoreBoard
from baton.services.decode.worker import DecodeWorker
from baton.services.gateway.server import Gateway
from baton.services.prefill.worker import PrefillWorker
from baton.services.prefix_index import IndexActor, IndexSpec
from baton.services.redis_server import RedisServer, redis_binary
from baton.services.registry import REGISTRY_NAME, Registry
from baton.services.router.adapters import AdapterRefused, AdapterTable
from baton.services.router.prefix import PrefixRouter
from baton.services.router.router import Router
from baton.services.router.wire import ModelInfo
from baton.services.worker import WorkerSpec, pin_process
from baton.tracing import Tracing, TracingConfig

log = logging.getLogger(__name__)


def assign_cpus(free: list[int], threads: int) -> list[int] | None:
    """Take ``threads`` cores off the front of ``free`` (in place) for one worker; None when fewer are
    left (that worker is not pinned). Pinned, the decode worker's step does not share its core with the
    prefill worker's passes or wait for the OS to move it back (measured on 2 cores, 16 clients, q4:
    384-395 -> 460-463 tokens/s, TPOT 33.6 -> 29.5 ms)."""
    if threads < 1 or len(free) < threads:
        return None
    cpus, free[:] = free[:threads], free[threads:]
    return cpus


def choose_index(flag: str | None, env: str | None, have_redis_server: bool) -> str:
    """The prefix index to use: a Redis URL, "private" (start a redis-server) or "memory"."""
    url = flag or env
    if url:
        check_redis_url(url, "Redis URL" if flag else "BATON_REDIS_URL")
        return url
    if have_redis_server:
        return "private"
    log.warning("prefix index: no Redis URL (--redis-url or BATON_REDIS_URL) and no redis-server installed; "
                "using an in-memory index (this stack's router alone can use it)")
    return "memory"


# Ray's own switches, read from the environment by every Ray process it starts.
RAY_LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # a single-node Ray: its node address is loopback
_ray_token_file: str | None = None


GCS_START_WAIT_S = 120


def private_ray_environment() -> str:
    """Before a local ``ray.init``: Ray's servers on loopback and Ray's token authentication on, with a random
    token in a file of mode 0600 in a folder of mode 0700 (made once per process, removed when the process
    ends, even by SIGKILL under ``baton serve``'s watcher). Returns the token file's path.

    Without it a local Ray listens on all interfaces (its node address is the host's outward one), and its
    token, where Ray turns authentication on by itself, is the one every local Ray of the user shares
    (~/.ray/auth_token, of the default file mode)."""
    global _ray_token_file
    if _ray_token_file is None:
        folder = tempfile.mkdtemp(prefix="baton-auth-")
        reaper.own_dir(folder)
        atexit.register(shutil.rmtree, folder, True)
        path = os.path.join(folder, "ray_token")
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        _ray_token_file = path
    os.environ.update({**RAY_LOOPBACK_ONLY, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": _ray_token_file})
    # Ray waits 30 s for its GCS to start; the first start from a fresh install, on a busy small machine, can
    # take longer (its binaries paged in from disk). An operator's own setting stays.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(GCS_START_WAIT_S))
    # This process read both when it imported Ray; its own view must follow, as Ray's own code does when it
    # turns token authentication on (ray._private.authentication).
    import ray._private.ray_constants as ray_constants
    from ray._raylet import Config

    ray_constants.ENABLE_RAY_CLUSTER = False
    Config.initialize("")
    return _ray_token_file


def _gcs_wants_token(gcs_address: str) -> bool | None:
    """Asks a Ray GCS something harmless with no token: True when it refuses (token authentication on), False when
    it answers, None when it cannot be reached from here."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(gcs_service_pb2.GetClusterIdRequest(),
                                                                              timeout=10)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return True
            return None
    return False


def ray_cluster_wants_token() -> bool | None:
    """Whether the Ray cluster this process has joined refuses callers without its token. Asked from here, else
    (a ``ray://`` client that cannot reach the GCS itself) from a task inside the cluster."""
    gcs = ray_address()
    answer = _gcs_wants_token(gcs)
    if answer is None:
        try:
            answer = ray.get(ray.remote(num_cpus=0)(_gcs_wants_token).remote(gcs), timeout=120)
        except Exception:  # noqa: BLE001 - no task ran or answered: cannot tell
            return None
    return answer


def cluster_auth_refusal(address: str, wants_token: bool | None) -> str | None:
    """Why ``baton serve --address`` does not join a cluster, given whether its GCS wants a token (None: it could
    not be asked, from here nor from a task in the cluster); None when it may join."""
    if wants_token:
        return None
    if wants_token is None:
        return (f"could not tell whether the Ray cluster at {address} requires Ray's token authentication: its GCS "
                "did not answer from here nor from a task in the cluster; check that it is up and reachable, or "
                "pass --allow-unauthenticated-ray to join it anyway")
    return (f"the Ray cluster at {address} runs without Ray's token authentication, so anyone who reaches its "
            "ports can run code in it: start it with RAY_AUTH_MODE=token (deploy/README.md), or pass "
            "--allow-unauthenticated-ray to join it anyway")


def ray_address() -> str:
    """The GCS address of the Ray this process is connected to (what ``--address`` and ``ray.init`` take)."""
    return ray.get_runtime_context().gcs_address


def _registry(namespace: str):
    """The registry actor of the stack named ``namespace`` on the Ray this process is connected to, or None."""
    try:
        return ray.get_actor(REGISTRY_NAME, namespace=namespace)
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """What a router needs to serve a running stack: the stack's launcher leaves it in the registry, and each
    `baton router` replica reads it there. Same model, same prefix index, same limits, same adapters at start."""

    model_path: str | None  # the model file or folder, for the tokenizer (None: the default model)
    model: ModelInfo
    block_size: int
    model_config: object  # the model's ModelConfig: the shapes LoRA adapters are checked against
    index: IndexSpec | None
    prefix_routing: object  # PrefixRoutingConfig
    limits: object  # Limits
    lora: tuple[str, ...]
    lora_root: str | None
    max_lora_rank: int
    max_loras: int

    def adapters(self) -> AdapterTable:
        """The adapter table with the start-up adapters listed; ConfigError naming the ``--lora`` that fails."""
        table = AdapterTable(self.model_config, self.model.name, self.max_lora_rank, self.lora_root, self.max_loras)
        for entry in self.lora:
            name, _, path = entry.partition("=")
            try:
                table.add(name, path, at_start=True)
            except (LoraError, AdapterRefused) as e:
                raise ConfigError(f"--lora {name}: {e}") from None
        return table

    def router(self, registry, tokenizer, config: ServeConfig, adapters: AdapterTable, tracing: Tracing,
               tokens: Tokens | None, key: str | None) -> Router:
        """A router for the stack: its workers from ``registry``, its prefix index, its limits; where it listens
        and its TLS from ``config``."""
        return Router(tokenizer, self.model, config.host, config.port,
                      discover=lambda: ray.get(registry.workers.remote(), timeout=5),
                      prefix=PrefixRouter(self.index.connect() if self.index else None, self.block_size,
                                          self.model.name, self.prefix_routing),
                      tracing=tracing, forget=lambda name: ray.get(registry.unregister.remote(name), timeout=5),
                      limits=self.limits, tls=config.tls, tokens=tokens, gateway_key=key, adapters=adapters)


class RouterReplica:
    """`baton router`: one more router for a running stack (``config.stack_name`` on the Ray at ``config.address``
    or RAY_ADDRESS), with no state of its own to lose: the workers come from the stack's registry, prefix hits
    from its index, limits and adapters from the launcher's ``RouterSpec``. N of them can sit behind one load
    balancer; a replica that dies takes only its own streams (the workers free their blocks when the
    connection goes)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.router: Router | None = None
        self.gateway: Gateway | None = None
        self.tracing: Tracing | None = None
        self.spec: RouterSpec | None = None
        self.metrics_address: str | None = None

    def start(self) -> RouterReplica:
        c = self.config
        tokens = Tokens.load(c.auth_tokens_file)
        address = c.address or os.environ.get("RAY_ADDRESS")
        if not address:
            raise ConfigError("baton router serves a running stack: give its Ray's --address (or RAY_ADDRESS)")
        if not c.stack_name:
            raise ConfigError("baton router needs --stack-name: the name `baton serve` printed (or was given)")
        if not ray.is_initialized():
            ray.init(address=address, namespace=c.stack_name, log_to_driver=False)
            if not c.allow_unauthenticated_ray:
                refusal = cluster_auth_refusal(address, ray_cluster_wants_token())
                if refusal is not None:
                    ray.shutdown()
                    raise ConfigError(refusal)
        registry = _registry(c.stack_name)
        spec = ray.get(registry.router_spec.remote(), timeout=30) if registry is not None else None
        if spec is None:
            raise ConfigError(f"no stack named {c.stack_name!r} serves on the Ray at {address}")
        self.spec = spec
        key = gateway_key() if c.http_port is not None or os.environ.get("BATON_GATEWAY_KEY") else None
        self.tracing = Tracing(TracingConfig.from_env(c.otlp_endpoint), "router", "router")
        self.router = spec.router(registry, load_tokenizer(spec.model_path), c, spec.adapters(), self.tracing, tokens,
                                  key)
        if c.metrics_port is not None:
            self.metrics_address = f"{c.host}:{serve_metrics(c.host, c.metrics_port)}"
        self.router.refresh()
        self.router.start()
        if c.http_port is not None:
            self.gateway = Gateway(self.router.address, c.host, c.http_port, spec.limits.max_message_bytes, c.tls,
                                   key).start()
        return self

    @property
    def address(self) -> str:
        assert self.router is not None
        return self.router.address

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        if self.router is not None:
            self.router.stop()
        if self.tracing is not None:
            self.tracing.shutdown()


class Stack:
    """Starts Ray (or joins it), the workers as Ray actors and the router; ``stop`` tears it all down."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.namespace = config.stack_name or f"baton-{uuid.uuid4().hex[:8]}"
        self.prefill: list = []
        self.decode: list = []
        self.router: Router | None = None
        self.gateway: Gateway | None = None  # the OpenAI-compatible HTTP API
        self.registry = None
        self.index_actor = None
        self.redis: RedisServer | None = None  # the private one, when this stack started it
        self.index: IndexSpec | None = None
        self.tracing: Tracing | None = None
        self.metrics_addresses: dict[str, str] = {}
        self.names: dict = {}  # worker handle -> name
        self.autoscaler: Autoscaler | None = None
        self._count = {"prefill": 0, "decode": 0}
        self._actor_classes: dict = {}
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self._owns_ray = False
        self.ray_token_file: str | None = None  # the local Ray's token, when this stack started that Ray
        self._ray_dir: str | None = None  # the local Ray's temporary folder, when this stack started that Ray
        self._free_cpus: list[int] | None = None  # cores not yet given to a worker; None: no pinning
        self.router_cpus: list[int] | None = None  # this process's cores, when pin_router pinned it
        self._cpus: dict = {}  # worker handle -> its cores
        self._all_cpus: list[int] = []  # every core the pinned workers get
        self._core_board: str | None = None  # the core board's file (services/cores.py), when cores are shared
        self.engine_config = config.engine  # the workers' (with the folder of their shared weights, when local)
        self._prepare: subprocess.Popen | None = None  # builds the shared weight image while Ray starts
        self.started_s: float | None = None  # seconds from start() to serving

    def start(self) -> Stack:
        began = time.monotonic()
        c = self.config
        self.tokens = Tokens.load(c.auth_tokens_file)  # before anything starts: a bad file is a config error
        for entry in c.lora:  # the folders before anything starts; their shapes once a worker knows the model's
            name, _, path = entry.partition("=")
            try:
                check_folder(path, c.engine.max_lora_rank)
            except LoraError as e:
                raise ConfigError(f"--lora {name}: {e}") from None
        # Shared with the HTTP gateways (this stack's, and standalone ones given BATON_GATEWAY_KEY).
        self._gateway_key = (gateway_key() if c.http_port is not None or os.environ.get("BATON_GATEWAY_KEY")
                             else None)
        use_index = c.engine.enable_prefix_caching
        # Checked before anything starts: a bad BATON_REDIS_URL is a configuration error.
        index_url = (choose_index(c.redis_url, os.environ.get("BATON_REDIS_URL"), redis_binary() is not None)
                     if use_index else None)
        address = c.address or os.environ.get("RAY_ADDRESS")
        # The router's tokenizer is read while Ray and the workers start (parsing a GGUF's vocabulary takes a second).
        tokenizer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="baton-tokenizer")
        tokenizer_future = tokenizer.submit(load_tokenizer, c.engine.model)
        tokenizer.shutdown(wait=False)
        workers = c.prefill + c.decode
        self._threads = c.threads_per_worker or max(1, (os.cpu_count() or 1) // workers)
        # This stack pins when it runs its own local Ray and every starting worker fits.
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if (c.pin_cpus and not ray.is_initialized() and not address
                and workers * self._threads <= len(cores)):
            self._free_cpus = list(cores)
            self._all_cpus = list(cores)
            if c.pin_router:
                # Before Ray starts, so that its own processes (and Redis) inherit it: this process
                # on the cores no worker takes, else the prefill workers' ones; the decode cores stay theirs.
                self.router_cpus = cores[workers * self._threads:] or cores[:c.prefill * self._threads]
                pin_process(self.router_cpus)
        if not ray.is_initialized():
            # A local Ray of our own: its worker processes (Ray starts them at niceness 15, below its own
            # daemons) run at normal priority. They are the serving processes; niced, they give their core
            # to any normal-priority process that lands there.
            kwargs = {} if address else {"object_store_memory": c.object_store_memory, "include_dashboard": False,
                                         "_system_config": {"worker_niceness": 0}}
            if not address:
                # Its sockets, logs and spill files in a folder of this stack's own (not the shared /tmp/ray,
                # which another user of the machine may own), removed when the stack ends, however it ends.
                self._ray_dir = kwargs["_temp_dir"] = tempfile.mkdtemp(prefix="baton-ray-")
                reaper.own_dir(self._ray_dir)
                if self._free_cpus is not None and c.share_cores:
                    self._core_board = CoreBoard.create(os.path.join(self._ray_dir, "cores"))
                self.ray_token_file = private_ray_environment()
                if self.engine_config.shared_weights_dir is None:  # this node's workers share one copy
                    self.engine_config = dataclasses.replace(
                        self.engine_config, shared_weights_dir=os.path.join(self._ray_dir, "weights"))
                # The shared weight image is built while Ray starts (the workers map it when they start).
                self._prepare = subprocess.Popen([sys.executable, "-m", "baton.engine.weights",
                                                  config_json(self.engine_config)],
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                if cores and self.router_cpus:  # not held to this process's cores: no worker runs yet
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(self._prepare.pid, cores)
            # "local": a Ray of our own, even when another cluster on this machine is listed as current.
            for attempt in range(2 if not address else 1):
                try:
                    ray.init(address=address or "local", namespace=self.namespace, log_to_driver=False, **kwargs)
                    break
                except Exception as e:  # noqa: BLE001 - Ray raises plain Exception for a node that did not start
                    # Now and then a local Ray does not come up on a busy machine (its GCS never reports its port,
                    # or the node times out during startup): a second start is what a user would do.
                    if attempt or not ("gcs_server_port" in str(e) or "timed out" in str(e)):
                        raise
                    log.warning("the local Ray did not start (%s); starting it again", e)
                    with contextlib.suppress(Exception):
                        ray.shutdown()
            self._owns_ray = True
            if address and not c.allow_unauthenticated_ray:
                refusal = cluster_auth_refusal(address, ray_cluster_wants_token())
                if refusal is not None:
                    ray.shutdown()
                    self._owns_ray = False
                    raise ConfigError(refusal)
        if self.config.stack_name is not None and _registry(self.namespace) is not None:
            self.stop()
            raise ConfigError(f"a stack named {self.namespace!r} already runs on this Ray: give another "
                              "--stack-name")
        self.registry = ray.remote(Registry).options(name=REGISTRY_NAME, namespace=self.namespace,
                                                     **self._here()).remote()
        self.index = self._start_index(index_url) if use_index else None
        self._tracing_config = TracingConfig.from_env(c.otlp_endpoint)
        self.tracing = Tracing(self._tracing_config, "router", "router")
        spawned = [self._spawn("prefill") for _ in range(c.prefill)] + [self._spawn("decode") for _ in range(c.decode)]
        infos = ray.get([a.info.remote() for a in spawned])
        self._end_prepare(wait_s=60)  # the workers mapped its image (or built it first): it ends at once
        first = infos[0]
        model = ModelInfo(first.model, first.max_model_len, first.vocab_size)
        registry = self.registry
        # What a router needs to serve this stack: this one, and another (`baton router`) that reads it from the
        # registry.
        spec = RouterSpec(c.engine.model, model, first.block_size, first.model_config, self.index, c.prefix_routing,
                          c.limits, c.lora, c.lora_root, c.engine.max_lora_rank, c.engine.max_loras)
        try:
            adapters = spec.adapters()
        except ConfigError:
            self.stop()
            raise
        ray.get(registry.set_router_spec.remote(spec), timeout=30)
        self.router = spec.router(registry, tokenizer_future.result(), c, adapters, self.tracing, self.tokens,
                                  self._gateway_key)
        if c.metrics_port is not None:
            self.metrics_addresses["router"] = f"{c.host}:{serve_metrics(c.host, c.metrics_port)}"
        self.metrics_addresses.update({i.name: i.metrics_address for i in infos if i.metrics_address})
        self.router.refresh()  # the workers registered themselves while starting
        self.router.start()
        if c.http_port is not None:
            self.gateway = Gateway(self.router.address, c.host, c.http_port, c.limits.max_message_bytes,
                                   c.tls, self._gateway_key).start()
        # Always on: besides growing and shrinking pools it replaces workers that died.
        self.autoscaler = Autoscaler(self, c.autoscale_period_s).start()
        self.started_s = time.monotonic() - began
        return self

    # -- workers ------------------------------------------------------------------------------------------

    def _spawn(self, kind: str):
        """Create one worker actor (placed by its pool's resources and labels); returns its handle at once."""
        c = self.config
        pool = c.prefill_pool if kind == "prefill" else c.decode_pool
        index = next(self._serial)
        name = f"{kind}-{self._count[kind]}"
        self._count[kind] += 1
        mport = None if c.metrics_port is None else 0 if c.metrics_port == 0 else c.metrics_port + 1 + index
        device = c.engine.device
        if device == "auto" and ray.cluster_resources().get("GPU", 0) > 0:
            device = "cuda"  # a GPU cluster: one worker per GPU
        opts = {"name": name, "namespace": self.namespace, "num_cpus": 0, "max_concurrency": 32,
                **pool.actor_options(device)}
        with self._lock:  # the autoscaler's thread also starts and forgets workers
            cpus = assign_cpus(self._free_cpus, self._threads) if self._free_cpus is not None else None
        engine = self.engine_config
        if kind == "prefill":  # a prefill worker makes one token per request: nothing to speculate on
            engine = dataclasses.replace(engine, speculative="off", spec_draft_model=None)
        spec = WorkerSpec(name=name, engine=engine, host=c.host, threads=self._threads,
                          admission_wait=c.admission_wait, namespace=self.namespace, tracing=self._tracing_config,
                          metrics_port=mport, tls=c.tls, cpus=tuple(cpus) if cpus else None,
                          core_board=self._core_board if cpus else None,
                          share_cpus=tuple(x for x in self._all_cpus if x not in cpus) if cpus else None)
        if kind not in self._actor_classes:  # once per kind: each ray.remote exports the class again
            self._actor_classes[kind] = ray.remote(PrefillWorker if kind == "prefill" else DecodeWorker)
        cls = self._actor_classes[kind].options(**opts)
        if kind == "prefill":
            handle = cls.remote(spec, c.max_export_bytes, c.export_lease_s, index=self.index)
        else:
            handle = cls.remote(spec, c.pull_timeout_s)
        with self._lock:
            (self.prefill if kind == "prefill" else self.decode).append(handle)
            self.names[handle] = name
            if cpus:
                self._cpus[handle] = cpus
        return handle

    @property
    def pinned(self) -> bool:
        """Whether this stack gives its workers their own cores."""
        return self._free_cpus is not None

    @property
    def worker_cpus(self) -> dict[str, list[int]]:
        """The cores of each pinned worker, by name."""
        with self._lock:
            return {self.names[h]: cpus for h, cpus in self._cpus.items() if h in self.names}

    def add_worker(self, kind: str, timeout_s: float = 300.0) -> str:
        """Start one more worker of ``kind`` and wait until it serves; the router finds it by discovery."""
        handle = self._spawn(kind)
        try:
            info = ray.get(handle.info.remote(), timeout=timeout_s)
        except Exception:
            self._forget(handle)
            with contextlib.suppress(Exception):
                ray.kill(handle)
            raise
        if info.metrics_address:
            self.metrics_addresses[info.name] = info.metrics_address
        return info.name

    def remove_worker(self, handle, drain_timeout_s: float = 120.0) -> bool:
        """Drain a worker (no new requests, finish those in flight, leave discovery), then stop it.
        Returns whether it drained within the timeout."""
        self._forget(handle)
        drained = False
        with contextlib.suppress(Exception):  # a dead worker drains nothing
            drained = ray.get(handle.drain.remote(drain_timeout_s), timeout=drain_timeout_s + 30)
        with contextlib.suppress(Exception):
            ray.get(handle.shutdown.remote(), timeout=10)
        with contextlib.suppress(Exception):
            ray.kill(handle)
        return drained

    def _forget(self, handle) -> None:
        with self._lock:
            for pool in (self.prefill, self.decode):
                if handle in pool:
                    pool.remove(handle)
            name = self.names.pop(handle, None)
            cpus = self._cpus.pop(handle, None)
            if cpus and self._free_cpus is not None:  # its cores go back to the free list
                self._free_cpus = sorted(self._free_cpus + cpus)
        if name is not None:
            self.metrics_addresses.pop(name, None)

    @staticmethod
    def _here() -> dict:
        """Options that keep a control-plane actor (registry, in-memory index) on this launcher's node: it
        lives and dies with the router, not with whichever worker node Ray would pick."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = ray.get_runtime_context().get_node_id()
        return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}

    def _start_index(self, url: str) -> IndexSpec:
        c = self.config
        if url == "private":
            self.redis = RedisServer(host="127.0.0.1").start()
            url = self.redis.url
            log.info("prefix index: private redis-server at %s", url)
        key_space = f"{self.namespace}:{c.engine.block_size}"
        if url == "memory":
            self.index_actor = ray.remote(IndexActor).options(
                name="baton-prefix-index", namespace=self.namespace, **self._here()).remote(c.index_ttl_s)
            # Up before anyone calls it: its clients allow a call one second, less than a busy node can
            # take to start an actor's process.
            try:
                ray.get(self.index_actor.lookup.remote([]), timeout=120)
            except Exception as e:  # noqa: BLE001 - any failure here means the stack cannot start
                raise RuntimeError(f"the in-memory prefix index (a Ray actor) did not start: {e}") from e
            return IndexSpec("actor:baton-prefix-index", key_space, c.index_ttl_s, self.namespace)
        return IndexSpec(url, key_space, c.index_ttl_s)

    def _end_prepare(self, wait_s: float) -> None:
        """Reap the weight-image build, killing it when it has not ended within ``wait_s``."""
        if self._prepare is None:
            return
        try:
            self._prepare.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self._prepare.kill()
            self._prepare.wait()
        self._prepare = None

    def memory(self) -> dict:
        """Memory now: each worker's MemoryReport (by name), and this process tree's (the launcher with everything
        it started on this host: Ray's daemons and workers, Redis) process count, resident and proportional sets."""
        with self._lock:
            handles = dict(self.names)
        reports = dict(zip(handles.values(), ray.get([h.memory.remote() for h in handles], timeout=30)))
        return {"workers": reports, **process_tree_memory(os.getpid())}

    @property
    def address(self) -> str:
        assert self.router is not None
        return self.router.address

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        if self.autoscaler is not None:
            self.autoscaler.stop()
        if self.router is not None:
            self.router.stop()
        if self.tracing is not None:
            self.tracing.shutdown()
        for actor in self.prefill + self.decode:
            with contextlib.suppress(Exception):  # a dead worker needs no shutdown
                ray.get(actor.shutdown.remote(), timeout=10)
            ray.kill(actor)
        self.prefill, self.decode = [], []
        with contextlib.suppress(Exception):
            ray.kill(self.registry)
        if self.index_actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.index_actor)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        self._end_prepare(wait_s=0)
        if self._owns_ray:
            ray.shutdown()
        if self._ray_dir is not None:
            shutil.rmtree(self._ray_dir, ignore_errors=True)
            self._ray_dir = None
