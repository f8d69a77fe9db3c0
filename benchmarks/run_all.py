"""Run every benchmark, print one table of the figures that carry a goal, draw them if it can.

Each script runs in its own process (a hung or crashed one cannot take the others with it) and
its full output is kept; the table is built from the JSON object each prints last.

By default the throughput benchmark runs at its default size and the others with ``--quick``,
so the whole run takes under ~5 minutes on 2 cores; ``--full`` runs every script at its
default size (~15 min), ``--quick`` every one quick (~2 min). ``--save`` writes each
script's output to ``benchmarks/results/DATE_MACHINE_NAME[_quick].txt`` and the table to
``..._all.txt``; with matplotlib importable (``pip install -e .[bench]``) it also draws
``..._throughput.png``.

Run: python3 benchmarks/run_all.py [--quick | --full] [--save] [--machine 2core-cpu]
     [--only throughput,state,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
# name -> script; the order they run in.
SCRIPTS = {
    "throughput": "bench_throughput.py",
    "state": "bench_state.py",
    "stall": "bench_stall.py",
    "stream_state": "bench_stream_state.py",
    "memory": "bench_memory.py",
    "gpu_pin": "bench_gpu_pin.py",
}
# A script that runs longer than this is stopped; its row says so.
SCRIPT_TIMEOUT_S = 900


def run_script(name: str, quick: bool) -> tuple[str, dict[str, Any] | None, float, int]:
    """(full output, its last-line JSON or None, wall seconds, exit status)."""
    cmd = [sys.executable, os.path.join(HERE, SCRIPTS[name])] + (["--quick"] if quick else [])
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, check=False
        )
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out, rc = out + f"\n(stopped after {SCRIPT_TIMEOUT_S} s)", -1
    wall = time.monotonic() - t0
    summary = None
    for line in reversed(out.splitlines()):
        if line.startswith("{") and '"bench"' in line:
            try:
                summary = json.loads(line)
            except ValueError:
                pass
            break
    return out, summary, wall, rc


def _num(x: Any, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else str(x)


def _span(r: dict[str, Any]) -> str:
    return f"{_num(r['median'])} [{_num(r['min'])}-{_num(r['max'])}]"


def _rows_throughput(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    for w, v in s.items():
        if not isinstance(v, dict) or "ratios" not in v:
            continue
        r = v["ratios"]
        gl, gt = v.get("goal_limit"), v.get("goal_torch")
        rows.append([f"{w}: ours / limit", _span(r["ours_limit"]), f"<= {gl}" if gl else "-"])
        rows.append([f"{w}: torch / limit", _span(r["torch_limit"]), "-"])
        rows.append([f"{w}: ours / torch", _span(r["ours_torch"]), f"<= {gt}" if gt else "-"])
        if "torchdata_limit" in r:
            rows.append([f"{w}: torchdata / limit", _span(r["torchdata_limit"]), "-"])
    return rows


def _rows_state(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    for k, v in s.get("a", {}).items():
        if isinstance(v, dict):
            rows.append([f"state_dict() us, {k}", _num(v["state_dict_us_median"]), "<= 5"])
    if s.get("b"):
        rows.append(["resumed / fresh first batch", _num(s["b"].get("ratio_median")), "<= 1.1"])
    for c in s.get("c", []):
        rows.append([f"re-fetched on resume, {c['workers']} workers",
                     str(c["refetched_delivered_samples"]), "0"])  # fmt: skip
    return rows


def _rows_stall(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    for method, m in s.get("methods", {}).items():
        gaps = [k["max_gap_after_kill_s"] * 1e3 for k in m.get("kills", []) if not k["error"]]
        if gaps:
            rows.append([f"{method}: max gap after a kill (ms)", _num(max(gaps), 0),
                         "<= 250 + a task"])  # fmt: skip
    return rows


def _rows_stream_state(s: dict[str, Any]) -> list[list[str]]:
    return [[f"{k} / plain epoch", _num(v["ratio_median"]), "<= 1.10"]
            for k, v in s.items()
            if isinstance(v, dict) and "ratio_median" in v and k != "plain"]  # fmt: skip


def _rows_memory(s: dict[str, Any]) -> list[list[str]]:
    return [[f"{w}: ours / torch {k}", _num(v["ratio"][k]), "<= 1.10" if k != "epoch_s" else "-"]
            for w, v in s.get("memory", {}).items()
            for k in ("total_pss_mib", "shm_mib", "epoch_s")]  # fmt: skip


def _rows_gpu_pin(s: dict[str, Any]) -> list[list[str]]:
    if "skipped" in s:
        return [["pinned copies to the GPU", f"skipped ({s['skipped']})", "-"]]
    return [["ours / torch", _num(s.get("ratio_steady_median")), "<= 1.00"]]


_ROWS = {
    "throughput": _rows_throughput,
    "state": _rows_state,
    "stall": _rows_stall,
    "stream_state": _rows_stream_state,
    "memory": _rows_memory,
    "gpu_pin": _rows_gpu_pin,
}


def rows_for(name: str, s: dict[str, Any]) -> list[list[str]]:
    """Table rows (bench, figure, value, goal) from one script's summary."""
    return [[name, *row] for row in _ROWS[name](s)]


def draw(path: str, s: dict[str, Any]) -> bool:
    """A bar chart of each throughput workload as a multiple of the limit; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [w for w, v in s.items() if isinstance(v, dict) and "ratios" in v]
    sides = [k for k in ("ours_limit", "torch_limit", "torchdata_limit")
             if names and k in s[names[0]]["ratios"]]  # fmt: skip
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 4))
    width = 0.8 / max(1, len(sides))
    for i, side in enumerate(sides):
        med = [s[w]["ratios"][side]["median"] for w in names]
        lo = [m - s[w]["ratios"][side]["min"] for m, w in zip(med, names)]
        hi = [s[w]["ratios"][side]["max"] - m for m, w in zip(med, names)]
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=side.split("_")[0])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks([j + width * (len(sides) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(names)
    ax.set_ylabel("steady epoch / the machine's limit")
    ax.set_title("Epoch time as a multiple of the limit (median, min-max over rounds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="every script with --quick (~2 min)")
    g.add_argument("--full", action="store_true", help="every script at its default size")
    p.add_argument("--save", action="store_true", help="write the outputs to results/")
    p.add_argument("--machine", default="2core-cpu", help="machine name in the result files")
    p.add_argument("--only", default=",".join(SCRIPTS), help="comma-separated subset")
    args = p.parse_args()
    stamp = f"{datetime.date.today().isoformat()}_{args.machine}"
    rows: list[list[str]] = []
    summaries: dict[str, Any] = {}
    failed = []
    for name in args.only.split(","):
        quick = args.quick or (not args.full and name != "throughput")
        print(f"running {SCRIPTS[name]}{' --quick' if quick else ''} ...", flush=True)
        out, summary, wall, rc = run_script(name, quick)
        print(f"  {name}: {wall:.0f} s, exit status {rc}", flush=True)
        if args.save:
            # A quick run never takes the name of a full one.
            suffix = "_quick" if quick else ""
            with open(os.path.join(RESULTS, f"{stamp}_{name}{suffix}.txt"), "w") as f:
                f.write(out)
        if rc != 0 or summary is None:
            failed.append(name)
            rows.append([name, "FAILED", f"exit status {rc}", "-"])
            print(out[-3000:], file=sys.stderr)
            continue
        summaries[name] = summary
        share = summary.get("foreign_cpu_share") or 0.0
        rows += rows_for(name, summary)
        if share > 0.1:
            rows.append([name, "(noisy: other processes' CPU share)", f"{share:.0%}", "< 10%"])
    widths = [max(len(r[i]) for r in [["bench", "figure", "value", "goal"], *rows])
              for i in range(4)]  # fmt: skip
    lines = ["  ".join(h.ljust(w) for h, w in zip(["bench", "figure", "value", "goal"], widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append("value: median [min-max] over A/B rounds where a span is shown")
    table = "\n".join(lines)
    print()
    print(table)
    if args.save:
        with open(os.path.join(RESULTS, f"{stamp}_all.txt"), "w") as f:
            f.write(table + "\n" + json.dumps(summaries, sort_keys=True) + "\n")
        if "throughput" in summaries:
            png = os.path.join(RESULTS, f"{stamp}_throughput.png")
            if draw(png, summaries["throughput"]):
                print(f"drew {png}")
            else:
                print("matplotlib is not importable: no PNG (pip install -e .[bench])")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
