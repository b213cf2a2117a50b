"""The demo's outputs: a table of the runs against the high-precision baseline, the loss curves as PNG, JSON and
CSV."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from engine.ops.exact_gemm import native_bf16_gemm

COLUMNS = ["recipe", "train loss", "val loss", "val gap vs baseline %", "tokens/s", "speed vs baseline",
           "peak RSS MiB", "saved act. MiB", "saved act. vs baseline"]
#: with several processes: tokens/s is of all ranks together; this column, of one rank (RSS and saved
#: activations are rank 0's)
PER_RANK = "tokens/s/rank"


def baseline_note(dtype: str) -> str:
    """Which dtype the baseline is, and why (printed above the table)."""
    why = "torch's bf16 GEMM is native here" if native_bf16_gemm() else "torch's bf16 GEMM is not native on this CPU"
    return f"{dtype} ({why}); the recipe runs keep {dtype} activations"


def baseline_result(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The baseline's result: the high-precision run in the runs' dtype (results before it existed: bf16)."""
    return next((r for r in results if r["recipe"] == r.get("dtype", "bf16")), None)


def columns(results: list[dict[str, Any]]) -> list[str]:
    if max(r.get("ranks", 1) for r in results) == 1:
        return COLUMNS
    return [*COLUMNS[:5], PER_RANK, *COLUMNS[5:]]


def speed_vs(result: dict[str, Any], base: dict[str, Any]) -> float:
    """Speed relative to `base`: from the interleaved step times when measured (`engine.train.speed`), else
    from the runs' own tokens/s."""
    if "interleaved_step_seconds" in result and "interleaved_step_seconds" in base:
        return base["interleaved_step_seconds"] / result["interleaved_step_seconds"]
    return result["tokens_per_second"] / base["tokens_per_second"]


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    base = baseline_result(results)
    rows = []
    for r in results:
        gap = "" if base is None else f"{100 * (r['final_val_loss'] - base['final_val_loss']) / base['final_val_loss']:+.2f}"
        speed = "" if base is None else f"{speed_vs(r, base):.2f}"
        act = "" if base is None else f"{r['saved_activation_bytes'] / base['saved_activation_bytes']:.2f}"
        per_rank = [f"{r['tokens_per_second'] / r.get('ranks', 1):.0f}"] if PER_RANK in columns(results) else []
        rows.append([r["recipe"], f"{r['final_train_loss']:.4f}", f"{r['final_val_loss']:.4f}", gap,
                     f"{r['tokens_per_second']:.0f}", *per_rank, speed, f"{r['peak_rss_bytes'] / 2**20:.0f}",
                     f"{r['saved_activation_bytes'] / 2**20:.1f}", act])
    return rows


def format_optim_table(results: list[dict[str, Any]]) -> str:
    """The optimizer-state runs (--optim-states) against the fp32-state run: val loss gap, peak RSS, state bytes."""
    base = next((r for r in results if r.get("optim_states") == "fp32"), None)
    lines = ["| optimizer states | val loss | val gap vs fp32 states | peak RSS MiB | optimizer B/param | vs fp32 states |",
             "|---|---|---|---|---|---|"]
    for r in results:
        gap = "" if base is None else f"{100 * (r['final_val_loss'] - base['final_val_loss']) / base['final_val_loss']:+.2f}%"
        ratio = "" if base is None else f"{r['optimizer_bytes_per_param'] / base['optimizer_bytes_per_param']:.3f}"
        lines.append(f"| {r.get('optim_states')} | {r['final_val_loss']:.4f} | {gap} | {r['peak_rss_bytes'] / 2**20:.0f} | "
                     f"{r['optimizer_bytes_per_param']:.3f} | {ratio} |")
    return "\n".join(lines)


def format_table(results: list[dict[str, Any]]) -> str:
    """The table, under a line naming the baseline."""
    rows = [columns(results), *table_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    base = baseline_result(results)
    head = [] if base is None else [f"baseline: {baseline_note(base['recipe'])}"]
    return "\n".join(head + lines)


def plot_losses(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        first = r["steps"][0]
        losses = r["train_losses"]
        window = max(1, len(losses) // 30)
        smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
                  for i in range(len(losses))]
        ax_train.plot(range(first, first + len(losses)), smooth, label=r["recipe"], linewidth=1.2)
        steps, vals = zip(*r["val_losses"])
        ax_val.plot(steps, vals, marker="o", markersize=3, label=r["recipe"], linewidth=1.2)
    ax_train.set(title="train loss (moving average)", xlabel="step", ylabel="cross-entropy (nats/byte)")
    ax_val.set(title="validation loss", xlabel="step")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results: list[dict[str, Any]], out_dir: Path) -> dict[str, Path]:
    """results.json, results.csv (the table) and losses.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "csv": out_dir / "results.csv", "png": out_dir / "losses.png"}
    paths["json"].write_text(json.dumps(results, indent=1))
    with paths["csv"].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns(results))
        writer.writerows(table_rows(results))
    plot_losses(results, paths["png"])
    return paths
