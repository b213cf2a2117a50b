"""general_gemm GFLOP/s per recipe pairing vs a bf16 torch.matmul of the same shape, in one run.

    python benchmarks/bench_gemm.py [--size 4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, median_seconds, print_table  # noqa: E402

from engine.gemm import general_gemm  # noqa: E402
from engine.quantizers import (  # noqa: E402
    Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer,
)

E4M3 = torch.float8_e4m3fn


def pairings() -> dict[str, tuple]:
    return {
        "per-tensor E4M3 x E4M3": (Float8CurrentScalingQuantizer(E4M3), Float8CurrentScalingQuantizer(E4M3)),
        "block 1D x 2D (pow2)": (Float8BlockQuantizer(E4M3), Float8BlockQuantizer(E4M3, block_scaling_dim=2)),
        "block 1D x 2D (fp32 scales)": (Float8BlockQuantizer(E4M3, force_pow_2_scales=False),
                                        Float8BlockQuantizer(E4M3, block_scaling_dim=2, force_pow_2_scales=False)),
        "MXFP8 x MXFP8": (MXFP8Quantizer(E4M3), MXFP8Quantizer(E4M3)),
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> list[list[str]]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="M = N = K")
    args = parser.parse_args(argv)
    n = args.size
    flops = 2 * n**3
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    base = median_seconds(lambda: torch.matmul(a, b.t()), repeat=5)
    rows = [["bf16 torch.matmul (baseline)", f"{flops / base / 1e9:.0f}", "1.00"]]
    for name, (qa, qb) in pairings().items():
        qa.set_usage(columnwise=False)
        qb.set_usage(columnwise=False)
        x, w = qa(a), qb(b)
        t = median_seconds(lambda: general_gemm(x, w, out_dtype=torch.bfloat16), repeat=5)
        rows.append([f"general_gemm {name}", f"{flops / t / 1e9:.0f}", f"{base / t:.2f}"])
    print(f"GEMM {n}x{n}x{n}, bf16 out, medians ({torch.get_num_threads()} threads)\n{machine_line()}")
    print_table(["gemm", "GFLOP/s", "speed vs bf16"], rows)
    return rows


if __name__ == "__main__":
    main()
