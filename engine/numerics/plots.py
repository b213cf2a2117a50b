"""The inspector's PNGs, drawn from its records (matplotlib, a dependency of the demo, imported when drawing):

    sqnr_heatmap.png   SQNR (dB) by layer x step, one panel per GEMM operand (the rowwise usage, else columnwise)
    scale_traces.png   amax and the largest decode scale of each layer's forward operands over the steps
    gemm_error.png     per layer, each GEMM output's relative error at the last step (training and what-if)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from engine.recipes import OPERANDS
from engine.recipes.operands import operand_key

Record = dict[str, Any]
GEMMS = ("fprop", "dgrad", "wgrad")


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def _layers(records: list[Record]) -> list[str]:
    return list(dict.fromkeys(r["layer"] for r in records))


def _operand_grid(records: list[Record], source: str, operand: str) -> dict[tuple[str, int], float]:
    """(layer, step) -> SQNR of the operand's rowwise usage where recorded, else its columnwise one."""
    grid: dict[tuple[str, int], float] = {}
    for r in records:
        if r["kind"] == "operand" and r["source"] == source and r["operand"] == operand:
            key = (r["layer"], r["step"])
            if key not in grid or r["usage"] == "rowwise":
                grid[key] = _number(r["sqnr_db"])
    return grid


def plot_sqnr_heatmap(records: list[Record], path: Path, source: str = "train") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers, steps = _layers(records), sorted({r["step"] for r in records})
    operands = [operand_key(op) for op in OPERANDS]
    fig, axes = plt.subplots(2, 3, figsize=(15, 2 + 0.35 * len(layers) * 2), squeeze=False)
    for ax, operand in zip(axes.flat, operands):
        grid = _operand_grid(records, source, operand)
        values = np.array([[grid.get((layer, step), np.nan) for step in steps] for layer in layers])
        image = ax.imshow(np.where(np.isfinite(values), values, np.nan), aspect="auto", cmap="viridis")
        ax.set_title(operand)
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
        ax.set_xlabel("step")
        fig.colorbar(image, ax=ax, label="SQNR dB")
    fig.suptitle(f"SQNR of each GEMM operand ({source})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_scale_traces(records: list[Record], path: Path, source: str = "train") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_amax, ax_scale) = plt.subplots(1, 2, figsize=(13, 4.5))
    for operand in ("fprop_input", "fprop_weight", "dgrad_grad_output"):
        for layer in _layers(records):
            mine = [r for r in records if r["kind"] == "operand" and r["source"] == source and r["layer"] == layer
                    and r["operand"] == operand]
            if not mine:
                continue
            steps = [r["step"] for r in mine]
            ax_amax.plot(steps, [_number(r["amax"]) for r in mine], marker=".", label=f"{layer} {operand}")
            ax_scale.plot(steps, [_number(r["scale_max"]) for r in mine], marker=".", label=f"{layer} {operand}")
    for ax, what in ((ax_amax, "amax"), (ax_scale, "largest decode scale")):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"{what} ({source})")
    ax_scale.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_gemm_error(records: list[Record], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    gemm_records = [r for r in records if r["kind"] == "gemm"]
    last = max((r["step"] for r in gemm_records), default=0)
    layers = _layers(gemm_records)
    bars = [(source, gemm) for source in ("train", "what_if") for gemm in GEMMS
            if any(r["source"] == source and r["gemm"] == gemm for r in gemm_records)]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(layers) * max(len(bars), 1)), 4.5))
    width = 0.8 / max(len(bars), 1)
    for i, (source, gemm) in enumerate(bars):
        found = {r["layer"]: _number(r["rel_error"]) for r in gemm_records
                 if r["step"] == last and r["source"] == source and r["gemm"] == gemm}
        recipe = next((r["recipe"] for r in gemm_records if r["source"] == source), source)
        ax.bar(np.arange(len(layers)) + i * width, [found.get(layer, np.nan) for layer in layers], width,
               label=f"{gemm} ({source}: {recipe})")
    ax.set_xticks(np.arange(len(layers)) + 0.4 - width / 2, layers, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("relative error vs high precision")
    ax.set_title(f"GEMM output error per layer, step {last}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(records: list[Record], out: Path) -> list[Path]:
    """The three PNGs in `out` (created if needed); the paths written (none without records)."""
    if not records:
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sqnr_heatmap.png", out / "scale_traces.png", out / "gemm_error.png"]
    source = "train" if any(r["source"] == "train" for r in records) else "what_if"
    plot_sqnr_heatmap(records, paths[0], source)
    plot_scale_traces(records, paths[1], source)
    plot_gemm_error(records, paths[2])
    return paths
