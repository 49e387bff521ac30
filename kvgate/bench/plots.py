"""PNG charts of a bench run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kvgate.bench.stats import RequestResult, Summary


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def latency_cdfs(path: Path, runs: Mapping[str, Sequence[RequestResult]]) -> Path:
    """TTFT, ITL and end-to-end latency CDFs, one line per strategy (or rate)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (
        ("TTFT", lambda rs: [r.ttft for r in rs if r.ok and r.ttft is not None]),
        ("inter-token latency", lambda rs: [g for r in rs if r.ok for g in r.itls]),
        ("end-to-end latency", lambda rs: [r.e2e for r in rs if r.ok and r.e2e is not None]),
    )
    for ax, (title, pick) in zip(axes, panels, strict=True):
        for label, results in runs.items():
            values = [v * 1000 for v in pick(results)]
            if values:
                xs, ys = _cdf(values)
                ax.plot(xs, ys, label=label)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if title != "inter-token latency" else "fraction of gaps")
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def throughput_vs_rate(path: Path, series: Mapping[str, Sequence[Summary]]) -> Path:
    """Output tokens/s and TTFT p90 against the offered request rate, one line per strategy."""
    plt = _pyplot()
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for label, summaries in series.items():
        pts = sorted((s.request_rate, s) for s in summaries if s.request_rate is not None)
        if not pts:
            continue
        rates = [r for r, _ in pts]
        ax_tp.plot(rates, [s.output_tok_s for _, s in pts], marker="o", label=label)
        ax_ttft.plot(rates, [(s.ttft_p90_s or 0) * 1000 for _, s in pts], marker="o", label=label)
    ax_tp.set_title("output throughput vs offered rate")
    ax_tp.set_xlabel("requests/s offered")
    ax_tp.set_ylabel("output tokens/s")
    ax_ttft.set_title("TTFT p90 vs offered rate")
    ax_ttft.set_xlabel("requests/s offered")
    ax_ttft.set_ylabel("ms")
    for ax in (ax_tp, ax_ttft):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def comparison_bars(path: Path, summaries: Sequence[Summary], title: str = "") -> Path:
    """One chart comparing strategies: TTFT p50/p90, prefix hit rate (vs ideal), throughput."""
    plt = _pyplot()
    names = [s.strategy for s in summaries]
    xs = list(range(len(names)))
    fig, (ax_ttft, ax_hit, ax_tp) = plt.subplots(1, 3, figsize=(14, 4.2))

    width = 0.38
    p50 = [(s.ttft_p50_s or 0) * 1000 for s in summaries]
    p90 = [(s.ttft_p90_s or 0) * 1000 for s in summaries]
    ax_ttft.bar([x - width / 2 for x in xs], p50, width, label="p50")
    bars = ax_ttft.bar([x + width / 2 for x in xs], p90, width, label="p90")
    ax_ttft.bar_label(bars, labels=[f"{v:.0f}" for v in p90], fontsize=7)
    ax_ttft.set_title("time to first token (lower is better)")
    ax_ttft.set_ylabel("ms (log scale)")
    ax_ttft.set_yscale("log")  # strategies differ by orders of magnitude
    ax_ttft.legend(fontsize=8)

    hits = [(s.prefix_hit_rate or 0) * 100 for s in summaries]
    ax_hit.bar(xs, hits, 0.6, color="tab:green")
    ideal = next((s.ideal_prefix_hit_rate for s in summaries if s.ideal_prefix_hit_rate is not None), None)
    if ideal is not None:
        ax_hit.axhline(ideal * 100, color="black", linestyle="--", linewidth=1, label="best achievable")
        ax_hit.legend(fontsize=8, loc="lower right")
    ax_hit.set_ylim(0, 100)
    ax_hit.set_title("prefix-cache hit rate (engines' counters)")
    ax_hit.set_ylabel("% of prompt tokens")

    ax_tp.bar(xs, [s.output_tok_s for s in summaries], 0.6, color="tab:purple")
    ax_tp.set_title("output throughput")
    ax_tp.set_ylabel("tokens/s")

    for ax in (ax_ttft, ax_hit, ax_tp):
        ax.set_xticks(xs)
        ax.set_xticklabels(names, rotation=15, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def tenant_ttft_cdfs(path: Path, runs: Mapping[str, Mapping[str, Sequence[RequestResult]]]) -> Path:
    """One TTFT CDF panel per tenant, one line per run it took part in (`runs`: tenant -> run ->
    its results); the x axis is shared, so a tenant's panel shows what the others cost it."""
    plt = _pyplot()
    tenants = list(runs)
    fig, axes = plt.subplots(
        1, len(tenants), figsize=(3.6 * len(tenants) + 1, 3.8), sharex=True, squeeze=False
    )
    for ax, tenant in zip(axes[0], tenants, strict=True):
        for label, results in runs[tenant].items():
            values = [r.ttft * 1000 for r in results if r.ok and r.ttft is not None]
            if values:
                xs, ys = _cdf(values)
                ax.plot(xs, ys, label=label)
        ax.set_title(f"tenant {tenant}: TTFT CDF", fontsize=9)
        ax.set_xlabel("ms")
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("fraction of its requests")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def tenant_bars(
    path: Path, figures: Mapping[str, Mapping[str, tuple[float | None, float]]], shared: Sequence[str]
) -> Path:
    """Per run (`figures`: run -> tenant -> (TTFT p90 s, output tok/s)): each tenant's TTFT p90
    side by side; and for the runs in `shared` (tenants on the pool at once: their tokens add
    up to the pool's) the output throughput stacked by tenant."""
    plt = _pyplot()
    runs = list(figures)
    tenants = list(dict.fromkeys(t for per in figures.values() for t in per))
    xs = list(range(len(runs)))
    fig, (ax_ttft, ax_tp) = plt.subplots(1, 2, figsize=(14, 4.4))
    width = 0.8 / max(1, len(tenants))
    for k, tenant in enumerate(tenants):
        offset = (k - (len(tenants) - 1) / 2) * width
        values = [(figures[run].get(tenant, (None, 0.0))[0] or 0.0) * 1000 for run in runs]
        ax_ttft.bar([x + offset for x in xs], values, width, label=tenant)
    ax_ttft.set_title("TTFT p90 per tenant (lower is better)")
    ax_ttft.set_ylabel("ms (log scale)")
    ax_ttft.set_yscale("log")
    ax_ttft.legend(fontsize=8)
    together = [run for run in runs if run in shared]
    bottom = [0.0] * len(together)
    for tenant in tenants:
        values = [figures[run].get(tenant, (None, 0.0))[1] for run in together]
        if any(values):
            ax_tp.bar(range(len(together)), values, 0.6, bottom=bottom, label=tenant)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax_tp.set_title("the pool's output tokens/s in the arrival window, by tenant")
    ax_tp.set_ylabel("tokens/s")
    ax_tp.legend(fontsize=8)
    for ax, labels in ((ax_ttft, runs), (ax_tp, together)):
        ax.set_xticks(list(range(len(labels))))
        ax.set_xticklabels(labels, rotation=15, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
