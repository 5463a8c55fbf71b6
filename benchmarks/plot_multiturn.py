"""Plots of a multi-turn benchmark report (`run_multiturn.py` calls `plot_all`).

    python -m benchmarks.plot_multiturn [benchmarks/results/multiturn.json]

multiturn_ttft.png      mean TTFT per round, one line per configuration; the replays of the
                        last round (after a restart, or uncached) as separate markers
multiturn_hit_rate.png  prompt tokens served per tier (device / host / storage) per round,
                        one panel per configuration that cached anything

(`multiturn` is the report's name: `multiturn_smollm2.json` gives `multiturn_smollm2_ttft.png`.)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # after the backend is chosen

TIERS = ("device", "host", "storage")
TIER_COLORS = {"device": "#2b6cb0", "host": "#dd8a2e", "storage": "#38a169"}
DPI = 120
PANEL_W, PANEL_H = 3.2, 3.0
PANELS_PER_ROW = 3
MS = 1e3


def _rounds(run: dict[str, Any]) -> tuple[list[int], list[dict[str, Any]]]:
    rows = run["per_round"]
    return [r["round"] for r in rows], rows


def plot_ttft(report: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.get_cmap("tab10").colors
    for i, (label, run) in enumerate(report["runs"].items()):
        xs, rows = _rounds(run)
        ys = [(r["ttft_s"]["mean"] or 0) * MS for r in rows]
        color = colors[i % len(colors)]
        if run["replay_round"] is None:
            ax.plot(xs, ys, marker="o", color=color, label=label)
        else:
            ax.scatter(xs, ys, marker="*", s=160, zorder=3, color=color,
                       label=f"{label} (replay)")
    ax.set_xlabel("round")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r for run in report["runs"].values() for r in _rounds(run)[0]}))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(_title(report, "TTFT per round"), fontsize=9)
    return _save(fig, path)


def plot_hit_rate(report: dict[str, Any], path: Path) -> Path:
    runs = {k: r for k, r in report["runs"].items() if r["hit_rate"]["all"]}  # cached any
    ncols = min(PANELS_PER_ROW, len(runs))
    nrows = -(-len(runs) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(PANEL_W * ncols, PANEL_H * nrows),
                             sharey=True, squeeze=False)
    flat = axes.ravel()
    for ax in flat[len(runs):]:
        ax.set_visible(False)
    for ax, (label, run) in zip(flat, runs.items()):
        xs, rows = _rounds(run)
        bottom = [0.0] * len(xs)
        for tier in TIERS:
            ys = [(r["hit_rate"][tier] or 0) * 100 for r in rows]
            ax.bar(xs, ys, bottom=bottom, color=TIER_COLORS[tier], label=tier)
            bottom = [b + y for b, y in zip(bottom, ys)]
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("round")
        ax.set_xticks(xs)
        ax.set_ylim(0, 100)
    for row in axes:
        row[0].set_ylabel("prompt tokens cached (%)")
    flat[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(_title(report, "cache hit rate by tier per round"), fontsize=9)
    return _save(fig, path)


def _title(report: dict[str, Any], what: str) -> str:
    w, s = report["workload"], report["sizing"]
    return (f"{what}: {w['num_clients']} chats x {w['num_rounds']} rounds, "
            f"L1 {s['l1_tokens']:,} of {s['working_set']:,} tokens ({report['date'][:10]})")


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_all(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """The two plots, named after the report's JSON (`multiturn.json` -> `multiturn_ttft.png`,
    `multiturn_smollm2.json` -> `multiturn_smollm2_ttft.png`), so runs never overwrite
    another's plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(report.get("out") or "multiturn.json").stem
    return [plot_ttft(report, out_dir / f"{stem}_ttft.png"),
            plot_hit_rate(report, out_dir / f"{stem}_hit_rate.png")]


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else Path("benchmarks/results/multiturn.json")
    for p in plot_all(json.loads(path.read_text()), path.parent):
        print(p)


if __name__ == "__main__":
    main()
