"""Charts drawn from the benchmarks' last-line JSON summaries (matplotlib, Agg backend).

Each ``draw_*`` function returns False when matplotlib is not importable, so callers
(``run_all.py``, ``bench_timeline.py --png``) can go on without it. Images are kept small
(dpi 100) because they are committed under ``results/``.

Redraw from saved results:  python3 benchmarks/plots.py results/FILE_timeline.txt OUT.png
(the kind of chart is taken from the file's JSON ``bench`` field).
"""

from __future__ import annotations

import json
import sys
from typing import Any

DPI = 100
# one colour per loader, the same in every chart
COLOURS = {"ours": "tab:blue", "torch": "tab:orange", "torchdata": "tab:green", "limit": "black",
           "grain": "tab:red", "spdl": "tab:purple"}  # fmt: skip


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _load_line(s: dict[str, Any]) -> str:
    share = s.get("foreign_cpu_share")
    if share is None:
        return ""
    return f"other processes used {share:.0%} of the CPU during the run"


def draw_timeline(path: str, s: dict[str, Any]) -> bool:
    """Batches delivered vs time, one line per loader; kills as ticks, errors as a red X."""
    plt = _plt()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    stopped = []
    for r in s["loaders"]:
        base = r["name"].split(",")[0]
        ref = "no kills" in r["name"]
        colour = COLOURS.get(base, "grey")
        ts = [0.0, *r["times"]]
        ax.plot(ts, range(len(ts)), color=colour, linewidth=1.0 if ref else 2.0,
                linestyle=":" if ref else "-", label=r["name"], zorder=2 if ref else 3,
                drawstyle="steps-post")  # fmt: skip
        for k in r.get("kills", []):
            ax.plot([k["t"], k["t"]], [k["batch"] - 12, k["batch"] + 12], color=colour,
                    linewidth=1.2, zorder=4)  # fmt: skip
        if r.get("error"):
            ax.plot([r["t_error"]], [r["batches"]], marker="x", color="red", markersize=11,
                    markeredgewidth=2.5, zorder=5)  # fmt: skip
            stopped.append(r)
    if stopped:
        # one label for every loader that stopped, right of the rightmost X (they are close)
        text = "\n".join(f"{r['name']}: {r['error'].split(':')[0]} after batch {r['batches']}"
                         for r in stopped)  # fmt: skip
        anchor = max(stopped, key=lambda r: r["t_error"])
        ax.annotate(text, (anchor["t_error"], anchor["batches"]), textcoords="offset points",
                    xytext=(14, -10), fontsize=8, color="red", va="center")  # fmt: skip
    # legend entries for the markers (drawn per loader above, in the loader's colour)
    ax.plot([], [], marker="|", color="grey", linestyle="none", markersize=12,
            markeredgewidth=1.5, label="a worker SIGKILLed")  # fmt: skip
    ax.plot([], [], marker="x", color="red", linestyle="none", markeredgewidth=2.5,
            label="stopped with an error")  # fmt: skip
    ax.set_xlabel("seconds since the loader was constructed")
    ax.set_ylabel("batches delivered")
    ax.set_ylim(0, s["n_batches"] * 1.04)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.set_title(
        f"A worker SIGKILLed every {s['kill_every']} batches ({s['workers']} workers, "
        f"{s['start_method']}, batch {s['batch_size']}, {s.get('cpus', '?')} cores)\n"
        + _load_line(s),
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def draw_workers(path: str, s: dict[str, Any]) -> bool:
    """Steady epoch time per workload and num_workers as grouped bars (limit, ours, torch,
    torchdata); each loader's bar is labelled with its multiple of the limit."""
    plt = _plt()
    if plt is None:
        return False
    groups = [(w, k, res) for w, per in s["workloads"].items() for k, res in per.items()]
    sides = [x for x in ("limit", "ours", "torch", "torchdata")
             if groups and x in groups[0][2]["steady_s"]]  # fmt: skip
    fig, ax = plt.subplots(figsize=(1.7 * len(groups) + 1.6, 4.0))
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        xs = [j + (i - (len(sides) - 1) / 2) * width for j in range(len(groups))]
        ys = [res["steady_s"][side] for _, _, res in groups]
        bars = ax.bar(xs, ys, width, color=COLOURS[side], label=(
            "limit (no loader)" if side == "limit" else side),
            alpha=0.35 if side == "limit" else 0.9)  # fmt: skip
        if side != "limit":
            ax.bar_label(bars, [f"{res['x_limit'][side]:.1f}x" for _, _, res in groups],
                         fontsize=7, padding=1)  # fmt: skip
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{w}\n{k} worker{'s' if k != '1' else ''}" for w, k, _ in groups])
    ax.set_ylabel("steady epoch time (s)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    label = "; ".join(f"{w}: {per[next(iter(per))]['label']}" for w, per in s["workloads"].items())
    ax.set_title(
        f"Epoch time vs num_workers, {s['cores']}-core machine (2 workers = every core); "
        f"bar labels: x the limit\n{label}\n" + _load_line(s),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def draw_throughput(path: str, s: dict[str, Any]) -> bool:
    """A bar chart of each throughput workload as a multiple of the limit."""
    plt = _plt()
    if plt is None:
        return False
    names = [w for w, v in s.items() if isinstance(v, dict) and "ratios" in v]
    # Every loader measured on some workload (Grain and SPDL run on four of them only).
    sides = [f"{k}_limit" for k in ("ours", "torch", "torchdata", "grain", "spdl")
             if any(f"{k}_limit" in s[w]["ratios"] for w in names)]  # fmt: skip
    nan = float("nan")
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 4))
    width = 0.8 / max(1, len(sides))
    for i, side in enumerate(sides):
        r = [s[w]["ratios"].get(side, {"median": nan, "min": nan, "max": nan}) for w in names]
        med = [x["median"] for x in r]
        lo = [m - x["min"] for m, x in zip(med, r)]
        hi = [x["max"] - m for m, x in zip(med, r)]
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=side.split("_")[0],
               color=COLOURS.get(side.split("_")[0]))  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks([j + width * (len(sides) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(names)
    ax.set_ylabel("steady epoch / the machine's limit")
    ax.set_title("Epoch time as a multiple of the limit (median, min-max over rounds)\n"
                 + _load_line(s), fontsize=9)  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


DRAW = {"timeline": draw_timeline, "workers": draw_workers, "throughput": draw_throughput}


def summary_from_output(text: str) -> dict[str, Any] | None:
    """The last-line JSON summary of a script's output (None when there is none)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{") and '"bench"' in line:
            try:
                return dict(json.loads(line))
            except ValueError:
                return None
    return None


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        s = summary_from_output(f.read())
    if s is None or s.get("bench") not in DRAW:
        print(f"no summary of a drawable bench ({', '.join(DRAW)}) in {sys.argv[1]}",
              file=sys.stderr)  # fmt: skip
        return 1
    if not DRAW[s["bench"]](sys.argv[2], s):
        print("matplotlib is not importable", file=sys.stderr)
        return 1
    print(f"drew {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
