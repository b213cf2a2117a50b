"""The native exact GEMM (decode + the small AVX-512 kernel below its threshold) vs its addmm form, same run.

    python benchmarks/bench_small_gemm.py [--shapes 16x256x256,...] [--work-kib 2048] [--out bf16,fp32]

Per-tensor E4M3 operands A [M, K], B [N, K], a bias. The baseline is what exact_gemm ran before the kernel: the
native FP8 -> bf16 decode of both operands, then one `torch.addmm` with the scale product as alpha (fp32 operands
for an fp32 output). Each call is followed by `--work-kib` of other memory traffic (a copy), as inside a training
step, where addmm's caches are cold; that copy alone is measured too and subtracted. One thread, thread CPU time
of the least disturbed of many interleaved blocks (`common.least_disturbed_cpu_seconds`).

The baseline's four torch calls from Python cost a few us more than the same calls made inside exact_gemm: rows
where exact_gemm itself runs addmm (bf16 output above 2^21 MACs, fp32 with K > 512) show that difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import least_disturbed_cpu_seconds, machine_line, print_table  # noqa: E402

from engine.ops import native  # noqa: E402
from engine.ops.exact_gemm import gemm_dtype as exact_gemm_dtype  # noqa: E402

# the three GEMMs of a 16x256x256 Linear step (fwd, dgrad, wgrad), a sweep around the crossover, the demo's (engine
# train: 2048 tokens, d_model 128, MLP 512)
DEFAULT_SHAPES = ("16x256x256,16x256x256,256x256x16,32x512x512,64x512x512,128x512x512,256x256x256,512x512x64,"
                  "2048x384x128,2048x128x512,384x128x2048,128x512x2048")
OUT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def operands(m: int, n: int, k: int):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=g) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn)
    return a, torch.tensor([0.25]), b, torch.tensor([0.125]), torch.randn(n, generator=g)


def main(argv: list[str] | None = None, prog: str | None = None) -> list[list[str]]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="MxNxK list, comma separated")
    parser.add_argument("--work-kib", type=int, default=2048, help="other memory traffic after each call")
    parser.add_argument("--out", default="bf16,fp32")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ext = native._ext()
    src = torch.ones(args.work_kib * 256)
    dst = torch.empty_like(src)
    rows = []
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.lower().split("x"))
        a, sa, b, sb, bias_f = operands(m, n, k)
        for out_name in args.out.split(","):
            out_dtype = OUT[out_name]
            gemm_dtype = exact_gemm_dtype(out_dtype, a.device)  # bf16 only where the CPU's bf16 GEMM is native
            bias = bias_f.to(out_dtype)
            alpha = (sa * sb).item()

            def engine_call():
                ext.exact_gemm(a, sa, 0, 0, b, sb, 0, 0, bias, out_dtype, gemm_dtype == torch.bfloat16)
                dst.copy_(src)

            def addmm_call():
                lhs, rhs = ext.fp8_to_bf16(a, None), ext.fp8_to_bf16(b, None)
                if gemm_dtype != torch.bfloat16:
                    lhs, rhs = lhs.to(gemm_dtype), rhs.to(gemm_dtype)
                torch.addmm(bias.to(gemm_dtype).expand(m, n), lhs, rhs.t(), alpha=alpha)
                dst.copy_(src)

            calls = max(5, min(50, int(2e7 // max(1, m * n * k))))
            t = least_disturbed_cpu_seconds({"work": lambda: dst.copy_(src), "engine": engine_call,
                                             "addmm": addmm_call}, blocks=15, calls=calls, warmup=5)
            eng, base = t["engine"] - t["work"], t["addmm"] - t["work"]
            rows.append([f"{m}x{n}x{k}", out_name, f"{m * n * k / 1e6:.2f}", f"{base * 1e6:.1f}", f"{eng * 1e6:.1f}",
                         f"{eng / base:.2f}"])
    print(f"exact_gemm vs decode + addmm, thread CPU us per call after {args.work_kib} KiB of other traffic "
          f"(subtracted), 1 thread\n{machine_line()}")
    print_table(["MxNxK", "out", "MMACs", "addmm us (baseline)", "exact_gemm us", "time vs addmm"], rows)
    return rows


if __name__ == "__main__":
    main()
