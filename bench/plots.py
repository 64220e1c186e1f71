"""PNG plots (matplotlib, Agg): decode latency vs context length, and throughput vs concurrency."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt, fig, ax, path: Path, ticks: tuple[list, list[str]], xlabel: str, ylabel: str, title: str) -> None:
    """Shared axes styling (log2 x axis, y from 0) and saving."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(*ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def decode_latency_vs_context(long_context: dict, path: Path) -> bool:
    cases = long_context.get("cases") or []
    if not cases:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (("ours_sparse", "ours (block-sparse)", "o-"), ("ours_dense", "ours (all layers dense)", "s--"),
                              ("transformers", "transformers", "^:")):
        pts = [(c["context"], c[key]["ms_per_token"]) for c in cases if c[key].get("ms_per_token")]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ticks = ([c["context"] for c in cases], [f"{c['context'] // 1024}k" for c in cases])
    _finish(plt, fig, ax, path, ticks, "context length (tokens)", "decode latency (ms / token, batch 1)",
            "Decode latency vs context (same weights, float32 CPU)")
    return True


def throughput_vs_concurrency(server_load: dict, path: Path) -> bool:
    levels = server_load.get("levels") or []
    if not levels:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [lv["clients"] for lv in levels]
    ax.plot(xs, [lv["tok_s"] for lv in levels], "o-", label="server, streaming clients")
    off = server_load["offline_same_requests"]
    ax.axhline(off["tok_s"], color="gray", linestyle="--",
               label=f"offline engine, same {off['requests']} requests")
    _finish(plt, fig, ax, path, (xs, [str(x) for x in xs]), "concurrent clients", "output tokens / s",
            "Server throughput vs concurrency")
    return True


def write_plots(benchmarks: dict, out_dir: Path) -> list[str]:
    written = []
    lc, sl = benchmarks.get("long_context"), benchmarks.get("server_load")
    if lc and "error" not in lc and decode_latency_vs_context(lc, out_dir / "decode_latency_vs_context.png"):
        written.append("decode_latency_vs_context.png")
    if sl and "error" not in sl and throughput_vs_concurrency(sl, out_dir / "throughput_vs_concurrency.png"):
        written.append("throughput_vs_concurrency.png")
    return written
