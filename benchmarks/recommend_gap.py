"""The NVFP4 gap table and plot of docs/recommend.md, from runs of `python -m engine train` laid out as
ROOT/s<seed>/<run>/results.json, with <run> one of CONFIGS' keys (bf16 and nvfp4 are needed for a seed).
The default shape (docs/recommend.md's current table), each run on one thread, at most 2 at a time:

    for each seed S (SHAPE="--steps 500 --eval-every 50 --speed-rounds 0 --in-process --no-progress"):
      PYTHONPATH=. python benchmarks/recommend_demo.py --seed S --batches 2 --candidates nvfp4 --budget 0.2 \
          --threshold 0.01 --statistic grad --out ROOT/map_grad_sS.json
      OMP_NUM_THREADS=1 python -m engine train $SHAPE --seed S --recipes bf16 --out ROOT/sS/bf16      # likewise:
      #   nvfp4: --recipes nvfp4; hand: --recipes nvfp4:last_block_bf16;
      #   map_grad: --recipes nvfp4 --recipe-map ROOT/map_grad_sS.json;
      #   hp_fprop / hp_dgrad / hp_wgrad: --recipes nvfp4 --recipe-map a RecipeMap whose default is
      #     Debug(NVFP4BlockScaling(), high_precision=("fprop",)) / ("dgrad",) / ("wgrad",);
      #   4over6, no_2d, no_sr, no_rht, 4over6_all: --recipes nvfp4:4over6, nvfp4:disable_2d_quantization,
      #     nvfp4:disable_stochastic_rounding, nvfp4:disable_rht, nvfp4:4over6_all;
      #   (the previous table: map: --recipe-map of recommend_demo.py --batches 4 --threshold 0.002
      #   --statistic loss; map_gemm: --threshold 0.1 --statistic gemm; the earlier short shape, --seq-len 64
      #   --batch-size 8 --steps 200: switch / switch80: --switch-at 0.9 / 0.8, map_switch: the map and 0.9)
      PYTHONPATH=. python benchmarks/recommend_eval.py ROOT/sS/<run>   # each 4-bit run: its forward's share
    python benchmarks/recommend_gap.py ROOT docs/recommend_gap.png    # prints the table, writes the plot

ROOT/previous.json may hold earlier runs' final validation losses for runs this ROOT lacks (marked *; the runs
repeat bit for bit: a seed's run gives the same loss every time). Seeds without both a bf16 and an nvfp4 run are
left out; a run missing for a seed is left out of that row (the row
says how many seeds it has). The last column (with recommend_eval.py's eval.json) is the run's gap with its
final weights evaluated with the forward in bf16: what training in 4-bit did, without the 4-bit forward's own
error at validation.
"""
import json, statistics, sys
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/recommend_gap")
CONFIGS = [("nvfp4", "nvfp4"), ("hand", "nvfp4, last block bf16 (TE's hand rule)"),
           ("map_grad", "nvfp4, recommended map (gradient error, per GEMM)"),
           ("map", "nvfp4, recommended map (loss sensitivity)"),
           ("map_gemm", "nvfp4, recommended map (GEMM error)"),
           ("hp_fprop", "nvfp4, every fprop in bf16"), ("hp_dgrad", "nvfp4, every dgrad in bf16"),
           ("hp_wgrad", "nvfp4, every wgrad in bf16"),
           ("4over6", "nvfp4, 4over6 on weights"), ("4over6_all", "nvfp4, 4over6 on weights and inputs, no RHT"),
           ("no_2d", "nvfp4, 1D weight scaling"), ("no_sr", "nvfp4, no stochastic rounding"),
           ("no_rht", "nvfp4, no RHT"),
           ("switch", "nvfp4, bf16 for the last 10% of steps"),
           ("switch80", "nvfp4, bf16 for the last 20% of steps"),
           ("map_switch", "nvfp4, recommended map + bf16 for the last 10%")]
#: earlier runs of the same commands, where this ROOT has none: ROOT/previous.json, {"s<seed>": {run: {
#: "final_val_loss": ..., "four_bit_flop_share": ...}}} (the table marks them with *)
PREVIOUS = json.loads((ROOT / "previous.json").read_text()) if (ROOT / "previous.json").exists() else {}
def load(s, c):
    p = ROOT / f"s{s}" / c / "results.json"
    if p.exists():
        return json.loads(p.read_text())[0]
    earlier = PREVIOUS.get(f"s{s}", {}).get(c)
    return None if earlier is None else {**earlier, "previous": True}
def pm(sd):
    return "" if sd != sd else f" ± {sd:.2f}"  # one seed: no sd
def mark(s, c):
    return "*" if load(s, c).get("previous") else ""
def forward_free_gap(s, c):
    """The run's gap with its weights evaluated with a bf16 forward (recommend_eval.py), None without eval.json."""
    p = ROOT / f"s{s}" / c / "eval.json"
    if not p.exists():
        return None
    return 100 * (json.loads(p.read_text())["val_loss_bf16_forward"] - base[s]["final_val_loss"]) / base[s]["final_val_loss"]
found = {int(p.name[1:]) for p in ROOT.glob("s*") if p.is_dir()} | {int(k[1:]) for k in PREVIOUS}
seeds = sorted(s for s in found if load(s, "bf16") and load(s, "nvfp4"))
rows, per = [], {}
base = {s: load(s, "bf16") for s in seeds}
for key, label in CONFIGS:
    gaps, closed, shares, diffs = [], [], [], []
    for s in seeds:
        r, b, n = load(s, key), base[s], load(s, "nvfp4")
        if r is None or b is None or n is None:
            continue
        g = 100 * (r["final_val_loss"] - b["final_val_loss"]) / b["final_val_loss"]
        gn = 100 * (n["final_val_loss"] - b["final_val_loss"]) / b["final_val_loss"]
        gaps.append(g); closed.append(100 * (gn - g) / gn); shares.append(100 * r.get("four_bit_flop_share", 1.0))
        diffs.append(g - gn)
    per[key] = (label, gaps, diffs)
    if gaps:
        sd = statistics.stdev(gaps) if len(gaps) > 1 else float("nan")
        sdd = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
        n_gaps = [100 * (load(s, "nvfp4")["final_val_loss"] - base[s]["final_val_loss"]) / base[s]["final_val_loss"]
                  for s in seeds if load(s, key) is not None]
        mean_closed = 100 * (statistics.mean(n_gaps) - statistics.mean(gaps)) / statistics.mean(n_gaps)
        seeds_txt = "" if len(gaps) == len(seeds) else f" ({len(gaps)} seed{'s' if len(gaps) > 1 else ''})"
        free = [forward_free_gap(s, key) for s in seeds if load(s, key) is not None]
        free_txt = " / ".join("-" if f is None else f"{f:+.2f}%" for f in free) if any(f is not None for f in free) else "-"
        rows.append(f"| {label}{seeds_txt} | {' / '.join(f'{g:+.2f}%' + mark(s, key) for g, s in zip(gaps, [s for s in seeds if load(s, key) is not None]))} | {statistics.mean(gaps):+.2f}%{pm(sd)} | "
                    f"{statistics.mean(diffs):+.2f}{pm(sdd)} | {mean_closed:.0f}% | {statistics.mean(shares):.1f}% | {free_txt} |")
print("| run | gap to bf16, seeds " + " / ".join(str(s) for s in seeds) + " | mean ± sd | minus nvfp4's gap, same seed (points, mean ± sd) | share of the mean gap closed | GEMM FLOPs in 4-bit over the run | gap with a bf16 forward at validation |")
print("|---|---|---|---|---|---|---|")
bl = " / ".join(f"{base[s]['final_val_loss']:.4f}{mark(s, 'bf16')}" for s in seeds)
print(f"| bf16 (val loss {bl}) | - | - | - | - | 0% | - |")
for r in rows: print(r)
if PREVIOUS:
    print("\n(*: an earlier run of the same command, from ROOT/previous.json)")
# plot: gap per config per seed, and seed 0's validation curves
fig, (a1, a2) = plt.subplots(1, 2, figsize=(18, 5.4))
keys = [k for k, _ in CONFIGS if per.get(k, (0, [], []))[1]]
for i, k in enumerate(keys):
    gaps = per[k][1]
    a1.bar(i, statistics.mean(gaps), color="C%d" % i, alpha=0.5)
    a1.scatter([i] * len(gaps), gaps, color="k", s=12, zorder=3)
a1.axhline(0, color="k", lw=0.8)
a1.set_xticks(range(len(keys)), [per[k][0].replace("nvfp4, ", "").replace(" (TE's hand rule)", "\n(TE hand rule)").replace(" (", "\n(").replace(" + ", "\n+ ").replace(", per", ",\nper") + ("" if len(per[k][1]) == len(seeds) else f"\n({len(per[k][1])} of {len(seeds)} seeds)") for k in keys], fontsize=7, rotation=0)
a1.set_ylabel("final validation loss gap to bf16 (%)")
a1.set_title(f"NVFP4 gap to bf16, {len(seeds)} seeds (bar: mean, dots: seeds)")
for i, k in enumerate(keys):
    d = per[k][2]
    a2.bar(i, statistics.mean(d), color="C%d" % i, alpha=0.5)
    a2.scatter(range(i, i + 1) if len(d) == 1 else [i] * len(d), d, color="k", s=12, zorder=3)
a2.axhline(0, color="k", lw=0.8)
a2.set_xticks(range(len(keys)), a1.get_xticklabels(), fontsize=7, rotation=0)
a2.set_ylabel("gap minus nvfp4's gap, same seed (points)")
a2.set_title("paired with the nvfp4 run of the same seed (below 0: closer to bf16)")
fig.tight_layout()
out = sys.argv[2] if len(sys.argv) > 2 else "recommend_gap.png"
fig.savefig(out, dpi=90)
print("wrote", out)
