"""What a run measured: per-request records -> percentiles, throughput, goodput under an SLO and cost
per million output tokens; a table for the terminal and a dict for JSON. No clocks here: the
arithmetic works on recorded times, so tests can feed it known timings."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    id: str
    kind: str
    sent: float  # seconds since the run started
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # one arrival time per output token
    done: float | None = None
    error: str | None = None  # status code name (gRPC) or "HTTP 503", ...
    detail: str | None = None  # the error's message (its first 200 characters)
    # speculative decoding, from Baton's usage: passes with proposed tokens, proposed tokens, and of them kept
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None and bool(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (over the tokens counted, which a server may
        stream several to a message)."""
        t, n = self.token_times, max(self.output_tokens, len(self.token_times))
        return (t[-1] - t[0]) / (n - 1) if t and n > 1 else None

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.done is None else self.done - self.sent


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 1.0
    tpot_s: float = 0.1
    percentile: float = 95.0

    def met_by(self, r: RequestRecord) -> bool:
        return r.ok and r.ttft <= self.ttft_s and (r.tpot is None or r.tpot <= self.tpot_s)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(records: Sequence[RequestRecord], window_s: float, slo: SLO, price_per_hour: float | None
              ) -> dict:
    """Figures for one load level; ``window_s`` is the measured wall time (warm-up excluded)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    stats: dict = {"requests": len(records), "completed": len(ok), "window_s": window_s,
                   "errors": dict(Counter(r.error for r in records if r.error is not None)),
                   "error_details": {r.error: r.detail for r in reversed(records) if r.error is not None},
                   "requests_per_s": len(ok) / window_s if window_s > 0 else None,
                   "output_tokens": out_tokens,
                   "output_tokens_per_s": out_tokens / window_s if window_s > 0 else None,
                   "prompt_tokens": sum(r.prompt_tokens for r in ok),
                   "cached_prompt_tokens": sum(r.cached_tokens for r in ok)}
    drafts = sum(r.spec_drafts for r in ok)
    draft_tokens, accepted = sum(r.spec_draft_tokens for r in ok), sum(r.spec_accepted_tokens for r in ok)
    # speculative decoding: tokens a sequence made per pass with a draft (None: the server proposed nothing)
    stats["spec_mean_accepted_length"] = 1 + accepted / drafts if drafts else None
    stats["spec_acceptance"] = accepted / draft_tokens if draft_tokens else None
    series = {"ttft_s": [r.ttft for r in ok], "tpot_s": [r.tpot for r in ok if r.tpot is not None],
              "itl_s": [g for r in ok for g in r.itl], "e2e_s": [r.e2e for r in ok]}
    for name, values in series.items():
        for q in PERCENTILES:
            stats[f"{name}_p{q}"] = percentile(values, q)
        stats[f"{name}_mean"] = sum(values) / len(values) if values else None
    met = [r for r in records if slo.met_by(r)]
    stats["slo"] = asdict(slo)
    stats["goodput_requests_per_s"] = len(met) / window_s if window_s > 0 else None
    stats["slo_met_share"] = len(met) / len(records) if records else None
    p = slo.percentile
    ttft_p, tpot_p = percentile(series["ttft_s"], p), percentile(series["tpot_s"], p)
    stats["slo_met_at_percentile"] = (bool(ok) and len(ok) == len(records) and ttft_p is not None
                                      and ttft_p <= slo.ttft_s and (tpot_p is None or tpot_p <= slo.tpot_s))
    tps = stats["output_tokens_per_s"]
    stats["price_per_hour"] = price_per_hour
    stats["cost_per_million_output_tokens"] = (price_per_hour / 3600 / tps * 1e6
                                               if price_per_hour is not None and tps else None)
    return stats


def _fmt(v, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if v is None else f"{v * scale:.{digits}g}" if isinstance(v, float) else str(v)


def table(levels: Sequence[dict]) -> str:
    """One row per load level: what an operator reads first."""
    head = ("load", "req/s", "out tok/s", "TTFT p50", "p95", "p99", "TPOT p50", "p95", "p99", "ITL p99", "E2E p95",
            "goodput", "errors", "spec len")
    rows = [head]
    for lv in levels:
        s = lv["stats"]
        rows.append((lv["label"], _fmt(s["requests_per_s"]), _fmt(s["output_tokens_per_s"], digits=4),
                     *(_fmt(s[f"ttft_s_p{q}"], 1000) for q in (50, 95, 99)),
                     *(_fmt(s[f"tpot_s_p{q}"], 1000) for q in (50, 95, 99)),
                     _fmt(s["itl_s_p99"], 1000), _fmt(s["e2e_s_p95"], 1000), _fmt(s["goodput_requests_per_s"]),
                     str(sum(s["errors"].values())), _fmt(s.get("spec_mean_accepted_length"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + ("\n(latencies in ms; goodput in requests/s meeting the SLO; spec len: speculative "
                               "decoding's mean accepted length, tokens per pass with a draft)")


__all__ = ["PERCENTILES", "RequestRecord", "SLO", "percentile", "summarize", "table"]
