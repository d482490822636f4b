"""What a worker tells discovery about itself, and what the router reads back: one typed record."""

from __future__ import annotations

from dataclasses import dataclass

from baton.config import ModelConfig

KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerInfo:
    name: str  # its Ray actor name, unique in the stack's namespace
    kind: str  # prefill | decode
    address: str  # host:port of its gRPC server
    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    node_id: str = ""  # the Ray node it runs on
    cpus: list[int] | None = None  # the cores it may run on
    nice: int | None = None  # its scheduling priority
    metrics_address: str | None = None  # host:port of its Prometheus endpoint
    model_config: ModelConfig | None = None  # its model's shapes (the router checks LoRA adapters against them)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"worker kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
