"""Run every benchmark, print one table of the figures that carry a goal, draw them if it can.

Each script runs in its own process (a hung or crashed one cannot take the others with it) and
its full output is kept; the table is built from the JSON object each prints last.

By default the throughput, timeline and workers benchmarks run at their default size and the
others with ``--quick``, so the whole run takes ~6 minutes on 2 cores; ``--full`` runs every
script at its default size (~15 min), ``--quick`` every one quick (~2.5 min). ``--save``
writes each script's output to ``benchmarks/results/DATE_MACHINE_NAME[_quick].txt`` and the
table to ``..._all.txt``; with matplotlib importable (``pip install -e .[bench]``) it also
draws ``results/throughput.png``, ``timeline.png`` and ``workers.png`` (``plots.py``;
``NAME_quick.png`` after a quick run, so those never replace a full run's charts).

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
    "timeline": "bench_timeline.py",
    "workers": "bench_workers.py",
    "trainer_resume": "bench_trainer_resume.py",
}
# Run at their default size unless --quick (the others run --quick unless --full): the
# throughput table is the headline, and the two charts for the front page take ~1 min together.
FULL_BY_DEFAULT = ("throughput", "timeline", "workers")
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
        for peer in ("torchdata", "grain", "spdl"):
            if f"{peer}_limit" in r:
                rows.append([f"{w}: {peer} / limit", _span(r[f"{peer}_limit"]), "-"])
        if "ours_best_other" in r:
            best = v.get("best_other", "best other")
            rows.append([f"{w}: ours / {best}", _span(r["ours_best_other"]), "< 1"])
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


def _rows_timeline(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    n = s.get("n_batches")
    for r in s.get("loaders", []):
        if "no kills" in r["name"]:
            continue
        kills = len(r.get("kills", []))
        if r.get("error"):
            got = f"stopped at batch {r['batches']}: {r['error'].split(':')[0]}"
        else:
            got = f"{r['batches']} of {n} batches"
        rows.append([f"{r['name']}: worker SIGKILLed every {s['kill_every']} ({kills} kills)",
                     got, f"{n} of {n}"])  # fmt: skip
        if not r.get("error") and kills:
            rows.append([f"{r['name']}: longest gap over a kill (ms)",
                         _num(r["max_gap_spanning_kill_ms"], 0), "-"])  # fmt: skip
    return rows


def _rows_workers(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    for w, per in s.get("workloads", {}).items():
        for k, res in per.items():
            xs = res["x_limit"]
            rows.append([f"{w}, {k} worker(s): x the limit (ours / torch / torchdata)",
                         " / ".join(_num(xs[x]) for x in ("ours", "torch", "torchdata")
                                    if x in xs), "-"])  # fmt: skip
    return rows


_ROWS = {
    "throughput": _rows_throughput,
    "state": _rows_state,
    "stall": _rows_stall,
    "stream_state": _rows_stream_state,
    "memory": _rows_memory,
    "gpu_pin": _rows_gpu_pin,
    "timeline": _rows_timeline,
    "workers": _rows_workers,
}


def rows_for(name: str, s: dict[str, Any]) -> list[list[str]]:
    """Table rows (bench, figure, value, goal) from one script's summary."""
    return [[name, *row] for row in _ROWS[name](s)]


def draw_all(summaries: dict[str, Any], quick: dict[str, bool]) -> None:
    """Draw results/NAME.png for every chart whose script ran (NAME_quick.png after a quick
    run, so a quick run never replaces the charts of a full one); says so without matplotlib."""
    import plots

    for name, fn in plots.DRAW.items():
        if name not in summaries:
            continue
        png = os.path.join(RESULTS, f"{name}{'_quick' if quick[name] else ''}.png")
        if not fn(png, summaries[name]):
            print("matplotlib is not importable: no PNG (pip install -e .[bench])")
            return
        print(f"drew {os.path.relpath(png)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="every script with --quick (~2.5 min)")
    g.add_argument("--full", action="store_true", help="every script at its default size")
    p.add_argument("--save", action="store_true", help="write the outputs to results/")
    p.add_argument("--machine", default="2core-cpu", help="machine name in the result files")
    p.add_argument("--only", default=",".join(SCRIPTS), help="comma-separated subset")
    args = p.parse_args()
    stamp = f"{datetime.date.today().isoformat()}_{args.machine}"
    rows: list[list[str]] = []
    summaries: dict[str, Any] = {}
    failed = []
    quick_of: dict[str, bool] = {}
    for name in args.only.split(","):
        quick = args.quick or (not args.full and name not in FULL_BY_DEFAULT)
        print(f"running {SCRIPTS[name]}{' --quick' if quick else ''} ...", flush=True)
        quick_of[name] = quick
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
        draw_all(summaries, quick_of)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
