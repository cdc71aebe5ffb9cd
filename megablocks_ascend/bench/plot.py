"""The benchmarks' PNG plots (matplotlib: the optional dependency ``bench``).

:func:`fraction_of_ceiling`: ``benchmarks/bench_routing.py``'s plot, each routing op's fraction of
the copy ceiling per implementation. :func:`ours_vs_alternatives`: ``python -m megablocks_ascend
bench``'s, the time of ours and of every alternative the device has, per routing op and per layer
step.
"""

from __future__ import annotations

COLORS = {"ours": "#1f77b4", "upstream": "#ff7f0e", "torch": "#7f7f7f"}
_OTHER = ("#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22")


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError as e:
        raise RuntimeError("plots need matplotlib: pip install 'megablocks-ascend[bench]' (or matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    return plt


def _color(impl: str, seen: dict) -> str:
    if impl in COLORS:
        return COLORS[impl]
    if impl not in seen:
        seen[impl] = _OTHER[len(seen) % len(_OTHER)]
    return seen[impl]


def fraction_of_ceiling(results, ceiling, path, impls=("ours", "upstream", "torch"), shapes=None):
    """Fraction of the copy ceiling per op: do_bench (left) and graph-replay device time (right)."""
    from megablocks_ascend.bench.routing_ops import QUICK_SHAPES, SHAPES  # noqa: PLC0415
    plt = _pyplot()
    known = {**SHAPES, **QUICK_SHAPES, **(shapes or {})}
    names = list(dict.fromkeys(r["shape"] for r in results))
    fig, axes = plt.subplots(len(names), 2, figsize=(18, 3.8 * len(names)), squeeze=False)
    for row, sname in enumerate(names):
        rows = [r for r in results if r["shape"] == sname]
        ops = list(dict.fromkeys(r["op"] for r in rows))
        for col, (key, label) in enumerate((("frac_ceiling", "do_bench (host launch + device)"),
                                            ("graph_frac_ceiling", "device time (graph replay)"))):
            ax = axes[row, col]
            width = 0.8 / len(impls)
            for i, impl in enumerate(impls):
                vals = [next((r.get(key) or 0 for r in rows if r["op"] == op and r["impl"] == impl), 0)
                        for op in ops]
                xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(ops))]
                ax.bar(xs, vals, width, label=impl, color=COLORS.get(impl, "#2ca02c"))
                if impl == "ours":
                    for x_, v in zip(xs, vals):
                        if v:
                            ax.text(x_, v + 0.01, f"{v:.0%}", ha="center", va="bottom", fontsize=7)
            ax.axhline(0.9, color="k", ls="--", lw=0.8)
            ax.set_xticks(range(len(ops)))
            ax.set_xticklabels([o.replace("_scatter_wgrad", "_wgrad") for o in ops], rotation=20, fontsize=8)
            ax.set_ylim(0, 1.1)
            ax.set_ylabel("fraction of copy ceiling")
            ax.set_title(f"{sname} {known.get(sname, '')}: {label}; ceiling {ceiling:.0f} GB/s, minimal bytes",
                         fontsize=9)
            ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ours_vs_alternatives(rows, path, title=""):
    """One panel per (section, case): for each item (a routing op, the preparation, a fused NPU op, a
    layer step), a bar per implementation with its time in ms, log scale: its device time from graph
    replay where it has one, else (hatched) its host-launch + device time; above each alternative's
    bar how many times ours is faster, on the time both have (device time where both have it). Rows
    not timed are left out."""
    plt = _pyplot()
    panels = list(dict.fromkeys((r["section"], r["case"]) for r in rows if r.get("ms") is not None))
    if not panels:
        raise RuntimeError("nothing timed to plot")
    fig, axes = plt.subplots(len(panels), 1, figsize=(16, 3.6 * len(panels)), squeeze=False)
    seen = {}
    for ax, (section, case) in zip(axes[:, 0], panels):
        mine = [r for r in rows if (r["section"], r["case"]) == (section, case) and r.get("ms") is not None]
        items = list(dict.fromkeys(r["item"] for r in mine))
        impls = sorted(dict.fromkeys(r["impl"] for r in mine), key=lambda i: i != "ours")
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            xs, vals, notes, hatch = [], [], [], []
            for j, item in enumerate(items):
                group = [r for r in mine if r["item"] == item]
                r = next((r for r in group if r["impl"] == impl), None)
                if r is None:
                    continue
                ours = next((o for o in group if o["impl"] == "ours"), None)
                both = bool(r.get("graph_ms") and ours and ours.get("graph_ms"))
                base = (ours["graph_ms"] if both else ours["ms"]) if ours else None
                xs.append(j + (i - (len(impls) - 1) / 2) * width)
                vals.append(r.get("graph_ms") or r["ms"])
                hatch.append(not r.get("graph_ms"))
                notes.append("" if impl == "ours" or not base else
                             f"{(r['graph_ms'] if both else r['ms']) / base:.2g}x")
            bars = ax.bar(xs, vals, width, label=impl, color=_color(impl, seen))
            for bar, h in zip(bars, hatch):
                if h:
                    bar.set_hatch("//")
            for x_, v, note in zip(xs, vals, notes):
                if note:
                    ax.text(x_, v, note, ha="center", va="bottom", fontsize=6)
        ax.set_yscale("log")
        ax.set_xticks(range(len(items)))
        ax.set_xticklabels([str(i).replace("_scatter_wgrad", "_wgrad") for i in items], rotation=15, fontsize=8)
        ax.set_ylabel("ms (log)")
        ax.set_title(f"{title} {section}: {case} (device time from graph replay; hatched: host launch + device; "
                     f"labels: alternative / ours)", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
