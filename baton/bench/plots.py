"""PNG plots of bench results (matplotlib, no display needed): latency percentiles and goodput against
offered load, and a TTFT/TPOT scatter; several runs on the same axes for ``baton bench compare``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _x(level: dict) -> float:
    return level["value"]


def _xlabel(runs: Sequence[tuple[str, dict]]) -> str:
    modes = {lv["mode"] for _, r in runs for lv in r["levels"]}
    return "offered load (requests/s)" if modes == {"rate"} else \
        "concurrent clients" if modes == {"concurrency"} else "load (rate or clients)"


def plot_runs(runs: Sequence[tuple[str, dict]], out_dir: str | Path, prefix: str = "bench") -> list[Path]:
    """runs: (label, result dict as written by ``baton bench``). Returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    multi = len(runs) > 1

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, r in runs:
        levels = sorted(r["levels"], key=_x)
        xs = [_x(lv) for lv in levels]
        for q, style in ((50, "-"), (95, "--"), (99, ":")):
            name = f"{label} p{q}" if multi else f"p{q}"
            ax1.plot(xs, [_ms(lv["stats"][f"ttft_s_p{q}"]) for lv in levels], style, marker="o", label=name)
            ax2.plot(xs, [_ms(lv["stats"][f"tpot_s_p{q}"]) for lv in levels], style, marker="o", label=name)
    for ax, title in ((ax1, "TTFT"), (ax2, "TPOT")):
        ax.set_title(f"{title} percentiles")
        ax.set_xlabel(_xlabel(runs))
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    files.append(_save(fig, out / f"{prefix}-latency.png"))

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, r in runs:
        levels = sorted(r["levels"], key=_x)
        xs = [_x(lv) for lv in levels]
        ax1.plot(xs, [lv["stats"]["goodput_requests_per_s"] or 0 for lv in levels], marker="o", label=label)
        ax1.plot(xs, [lv["stats"]["requests_per_s"] or 0 for lv in levels], ":", marker=".", label=f"{label} (all)")
        ax2.plot(xs, [lv["stats"]["output_tokens_per_s"] or 0 for lv in levels], marker="o", label=label)
    slo = runs[0][1]["levels"][0]["stats"]["slo"] if runs and runs[0][1]["levels"] else {}
    ax1.set_title(f"goodput (TTFT <= {slo.get('ttft_s', '?')} s, TPOT <= {slo.get('tpot_s', '?')} s)")
    ax1.set_ylabel("requests/s")
    ax2.set_title("output throughput")
    ax2.set_ylabel("tokens/s")
    for ax in (ax1, ax2):
        ax.set_xlabel(_xlabel(runs))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    files.append(_save(fig, out / f"{prefix}-goodput.png"))

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, r in runs:
        for lv in r["levels"]:
            pts = [(q["ttft_s"], q["tpot_s"]) for q in lv["requests"] if q.get("ttft_s") is not None
                   and q.get("tpot_s") is not None]
            if pts:
                name = f"{label} {lv['label']}" if multi else lv["label"]
                ax.scatter([_ms(p[0]) for p in pts], [_ms(p[1]) for p in pts], s=10, alpha=0.6, label=name)
    if slo:
        ax.axvline(slo["ttft_s"] * 1000, color="grey", lw=0.8)
        ax.axhline(slo["tpot_s"] * 1000, color="grey", lw=0.8)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("requests: TTFT against TPOT (lines: the SLO)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    files.append(_save(fig, out / f"{prefix}-scatter.png"))
    return files


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ms(v: float | None) -> float:
    return float("nan") if v is None else v * 1000


__all__ = ["plot_runs"]
