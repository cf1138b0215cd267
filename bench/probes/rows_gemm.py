"""The prefill/decode tile probe of issue 50 (bench/notes/rows-design.md sec. 2 and sec. 8 step 1): does an R-row
skinny-GEMM tile (``opcodes.common_rows.rows_stream``) stream the weights as fast as today's GEMV at decode sizes,
and reach cuBLAS at prefill sizes?

    python -m bench.probes.rows_gemm [--shapes 1b,8b] [--n 1,16,32,128,512,2048] [--out DIR]   (a GPU)
    python -m bench.probes.rows_gemm --m 64 --bk 256 --stages 4 --warps 8 --n 16,32   (one tile config for every N)
    python -m bench.probes.rows_gemm --compile     (no GPU: the kernel compiled for sm_90; JSON of registers, spills)

PREDICTION (written before any GPU run).
* N = 16 (and N = 1, padded to 16): the HBM traffic is the weights alone (X^T, 16 columns, comes from the L2 and is
  <= 1/3 of a stage's shared memory), and the dot is ~2*32*16*BK FLOP a block, far below the tensor cores' rate, so
  the tile is a weight stream: time ~ W bytes / ~90% of the copy bandwidth, as today's GEMV (``gemv_stream``,
  timed here beside it). The risk is fewer weight bytes in flight a SM: a stage holds ``W[M, BK]`` plus
  ``X^T[BK, 16]`` (48 KB at M 32, BK 512), so 4 buffered stages (128 KB of W) instead of the GEMV's 5 (160 KB):
  expect N 16 within 0-8% of the GEMV (the go/no-go bar is 5%), and N 32 a few % behind N 16 (3 x 64 KB stages).
* N = 2048: compute-bound (8B gate+up: 481 GFLOP; H100 dense bf16 ~990 TFLOP/s peak, cuBLAS ~600-750).
  The tile is a 128x128x64 wgmma tile with cp.async pointer loads (no TMA, no warp specialization), 4 stages,
  8 warps, persistent over the SMs with the N blocks of one weight block on neighbouring programs (X^T, 4-29 MB,
  stays in the L2; W is read from the HBM about once). Expect 70-90% of cuBLAS: the 85% bar is at risk; below it
  the design's answer is TMA descriptors (``tl.make_tensor_descriptor``) before anything else.

Per shape (the preset's layer GEMMs: QKV (q_dim + 2 kv_dim) x d, O d x q_dim, gate+up 2 ffn x d, down d x ffn) and N:
the probe (``rows_gemm_kernel``: grid = the SMs, program p takes tiles p, p + G, ...; no waits, every launch is
bounded), ``torch.matmul`` (cuBLAS, ``X @ W^T`` as a Linear runs it) and at N <= 32 today's GEMV loop at N = 1.
Each result is checked against torch in fp32 first (max |err| / max |ref| <= TOL; a wrong result fails the run).
Times: CUDA events around each launch, the L2 flushed before it (the weights are not L2-resident in a decode
step), median of ``--reps`` (>= 20) after warm-up.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys

import torch
import triton
import triton.language as tl

from opcodes.common import gemv_stream
from opcodes.common_rows import rows_stream
from opcodes.tiling import next_pow2

#: the GPU check's bound on max |probe - fp32 reference| / max |reference| (bf16 outputs: ~2^-9 each)
TOL = 1e-2
SMEM_BUDGET = 200 * 1024     # bytes of pipeline stages a program may take (the design's rows tiling bound)
PRESETS = {"1b": "llama3.2-1b", "8b": "llama3.1-8b"}


@triton.jit
def rows_gemm_kernel(w_ptr, xt_ptr, yt_ptr, m_rows, n, xs, ys,
                     K: tl.constexpr, M: tl.constexpr, N_TILE: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr, TWO: tl.constexpr, EVEN: tl.constexpr,
                     INTERP: tl.constexpr):
    """``Y^T = W . X^T`` for a row-major bf16 ``W`` [m_rows (x 2 with TWO), K] and feature-major ``X^T`` [K, xs]
    (columns ``[0, n)``), ``Y^T`` [rows, ys]. Tile t: weight block ``t // n_tiles`` (M rows; with ``TWO`` also
    the same rows of the second half, as QKV's RoPE halves and gate/up), column block ``t % n_tiles``
    (``N_TILE`` columns)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    m_tiles = tl.cdiv(m_rows, M)
    n_tiles = tl.cdiv(n, N_TILE)
    for t in range(pid, m_tiles * n_tiles, G):
        nt = t % n_tiles
        rows1 = (t // n_tiles) * M + tl.arange(0, M)
        rm = rows1 < m_rows
        rows2 = rows1 + m_rows
        n0 = nt * N_TILE
        acc1, acc2 = rows_stream(w_ptr, rows1, w_ptr, rows2, rm, xt_ptr + n0, 0, n - n0, xs,
                                 K, K, M, N_TILE, BK, STAGES, TWO, EVEN, INTERP)
        cols = n0 + tl.arange(0, N_TILE)
        y1 = yt_ptr + rows1[:, None].to(tl.int64) * ys + cols[None, :]
        y2 = yt_ptr + rows2[:, None].to(tl.int64) * ys + cols[None, :]
        if EVEN:
            tl.store(y1, acc1)
            if TWO:
                tl.store(y2, acc2)
        else:
            om = rm[:, None] & (cols < n)[None, :]
            tl.store(y1, acc1, mask=om)
            if TWO:
                tl.store(y2, acc2, mask=om)


@triton.jit
def gemv_kernel(w_ptr, x_ptr, y_ptr, m_rows, K: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr,
                STAGES: tl.constexpr):
    """Today's one-row tile loop (``gemv_stream``, the column loop) over a whole matrix, persistent: the N = 1
    baseline the decode tiles must match."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    for t in range(pid, tl.cdiv(m_rows, ROWS), G):
        rows = t * ROWS + tl.arange(0, ROWS)
        acc, _, _ = gemv_stream(w_ptr, rows, w_ptr, rows, rows >= 0, x_ptr, x_ptr, 0, K, K, ROWS, BK, STAGES,
                                TWO=False, NORM=False, EVEN=True)
        tl.store(y_ptr + rows, tl.sum(acc, axis=1))


def _pow2(name: str, v: int, lo: int) -> None:
    if not isinstance(v, int) or v < lo or v & (v - 1):
        raise ValueError(f"{name} must be a power of two >= {lo}, got {v!r}")


def launch(w, xt, yt, n, *, m, n_tile, bk, stages, warps, grid, two=False):
    """Run ``rows_gemm_kernel``: ``yt[:, :n] = W . xt[:, :n]`` (with ``two`` the
    tiles pair rows r and r + rows/2). ``xt`` [K, xs] and ``yt`` [rows, ys] are row-major with xs, ys >= n; the
    masks are compiled out (EVEN) when K, the rows and n are multiples of the tile's. Returns EVEN."""
    if w.dim() != 2 or w.dtype != torch.bfloat16 or not w.is_contiguous():
        raise ValueError(f"w must be a contiguous 2-D bf16 tensor, got {tuple(w.shape)} {w.dtype}")
    rows, K = w.shape
    if xt.dim() != 2 or xt.shape[0] != K or not xt.is_contiguous():
        raise ValueError(f"xt must be a contiguous [K={K}, xs] tensor, got {tuple(xt.shape)}")
    if yt.dim() != 2 or yt.shape[0] != rows or not yt.is_contiguous():
        raise ValueError(f"yt must be a contiguous [rows={rows}, ys] tensor, got {tuple(yt.shape)}")
    if not (isinstance(n, int) and 1 <= n <= min(xt.shape[1], yt.shape[1])):
        raise ValueError(f"n must be an int in [1, min(xs, ys) = {min(xt.shape[1], yt.shape[1])}], got {n!r}")
    for name, v, lo in (("m", m, 16), ("n_tile", n_tile, 16), ("bk", bk, 16)):
        _pow2(name, v, lo)
    if two and rows % 2:
        raise ValueError(f"two=True needs an even number of weight rows, got {rows}")
    m_rows = rows // 2 if two else rows
    even = K % bk == 0 and m_rows % m == 0 and n % n_tile == 0
    interp = not w.is_cuda
    rows_gemm_kernel[(grid,)](w, xt, yt, m_rows, n, xt.shape[1], yt.shape[1],
                              K=K, M=m, N_TILE=n_tile, BK=bk, STAGES=stages, TWO=two, EVEN=even, INTERP=interp, num_warps=warps)
    return even


def reference(w, xt, n):
    """fp32 ``W . X^T[:, :n]`` as the tile computes it: the B operand rounded to bf16."""
    x = xt[:, :n].float()
    return w.float() @ x.to(torch.bfloat16).float()


def gemm_shapes(cfg) -> list[tuple[str, int, int]]:
    """(name, rows, K) of a layer's GEMMs."""
    return [("qkv", cfg.q_dim + 2 * cfg.kv_dim, cfg.d), ("o", cfg.d, cfg.q_dim), ("gate_up", 2 * cfg.ffn, cfg.d),
            ("down", cfg.d, cfg.ffn)]


def tile_config(cfg, K: int, n: int, m=None, n_tile=None, bk=None, stages=None, warps=None) -> dict:
    """The tile of N ``n`` (rows-design sec. 2): decode (n < 128) M 32, N_TILE next_pow2 >= 16, the preset's BK and
    warps, stages within 200 KB; prefill M 128, N_TILE 128, BK 64, 8 warps, 4 stages. Given values win."""
    from opcodes.tiling import Tiling
    t = Tiling.for_config(cfg)
    prefill = n >= 128
    c = dict(m=m or (128 if prefill else 32), n_tile=n_tile or (128 if prefill else max(16, next_pow2(n))),
             bk=min(bk or (64 if prefill else t.bk), next_pow2(K)), warps=warps or (8 if prefill else t.num_warps))
    stage = 2 * c["bk"] * (c["m"] + c["n_tile"])
    # Triton's pointer pipeline holds STAGES - 1 stages in shared memory (sm_90 compiles: 3 x 48 KB at STAGES 4)
    c["stages"] = stages or (4 if prefill else max(2, min(t.stages, SMEM_BUDGET // stage + 1)))
    return c


def _timed(fn, reps: int, flush) -> float:
    """Median us of ``fn()`` over ``reps`` launches, each bracketed by CUDA events, the L2 flushed before each."""
    for _ in range(3):
        fn()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in evs:
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in evs)


def _rel_err(got, ref) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def run(shapes, ns, reps=20, opts=None, out=None) -> list[dict]:
    from megatape.measure import stream_copy_bandwidth
    from opcodes.config import ModelConfig
    from opcodes.tiling import Tiling
    opts = opts or {}
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = stream_copy_bandwidth(dev, nbytes=1 << 30)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    print(f"{torch.cuda.get_device_name(dev)}: {sms} SMs, stream copy {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    for key in shapes:
        cfg = ModelConfig.from_name(PRESETS[key])
        t = Tiling.for_config(cfg)
        for gname, rows, K in gemm_shapes(cfg):
            w = (torch.randn(rows, K, device=dev, generator=g) * 0.02).to(torch.bfloat16)
            wbytes = rows * K * 2
            # today's GEMV (N = 1), the preset's column loop tiling
            x1 = torch.randn(K, device=dev, generator=g).to(torch.bfloat16)
            y1 = torch.empty(rows, device=dev, dtype=torch.float32)
            gbk = min(t.bk, next_pow2(K))

            def gemv():
                gemv_kernel[(sms,)](w, x1, y1, rows, K=K, ROWS=32, BK=gbk, STAGES=t.stages, num_warps=t.num_warps)
            gemv()
            err = _rel_err(y1, w.float() @ x1.float())
            if err > TOL:
                raise SystemExit(f"FAILED: gemv {key} {gname}: relative error {err:.2e} > {TOL}")
            gemv_us = _timed(gemv, reps, flush)
            t1 = None
            for n in ns:
                c = tile_config(cfg, K, n, **opts)
                npad = -(-n // c["n_tile"]) * c["n_tile"]
                x = torch.randn(n, K, device=dev, generator=g).to(torch.bfloat16)
                xt = torch.zeros(K, npad, device=dev, dtype=torch.bfloat16)
                xt[:, :n] = x.t()
                yt = torch.empty(rows, npad, device=dev, dtype=torch.bfloat16)

                def probe():
                    launch(w, xt, yt, npad, m=c["m"], n_tile=c["n_tile"], bk=c["bk"], stages=c["stages"],
                           warps=c["warps"], grid=sms)
                while True:     # a tile whose stages do not fit the SM's shared memory: one stage fewer (reported)
                    try:
                        probe()
                        break
                    except triton.runtime.errors.OutOfResources:
                        if c["stages"] <= 2:
                            raise
                        c["stages"] -= 1
                err = _rel_err(yt[:, :n], reference(w, xt, n))
                if err > TOL:
                    raise SystemExit(f"FAILED: rows {key} {gname} N {n} {c}: relative error {err:.2e} > {TOL}")
                us = _timed(probe, reps, flush)
                cub_us = _timed(lambda: torch.matmul(x, w.t()), reps, flush)
                t1 = us if n == 1 else t1
                r = dict(preset=key, gemm=gname, rows=rows, K=K, N=n, **c, us=us, cublas_us=cub_us, gemv_us=gemv_us,
                         tbps=wbytes / us / 1e6, tflops=2 * rows * K * n / us / 1e6, x_cublas=cub_us / us,
                         copy_frac=wbytes / bw * 1e6 / us, vs_gemv=gemv_us / us, vs_n1=(us / t1) if t1 else None,
                         err=err, copy_tbps=bw / 1e12)
                results.append(r)
                print(f"  {key} {gname:7s} {rows}x{K} N {n:5d}: {us:8.1f} us (cuBLAS {cub_us:8.1f}, "
                      f"GEMV {gemv_us:7.1f}) err {err:.1e}", flush=True)
            del w
    print(table(results))
    if out:
        p = pathlib.Path(out)
        p.mkdir(parents=True, exist_ok=True)
        (p / "rows_gemm.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev), sms=sms,
                                                          copy_bw=bw, tol=TOL, results=results), indent=1))
    return results


def table(results) -> str:
    head = ("| model | GEMM | rows x K | N | tile M/NT/BK/st/w | us | TB/s (W) | TFLOP/s | x cuBLAS (us) | "
            "of copy BW | x GEMV (us) | t/t(N=1) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(f"| {r['preset']} | {r['gemm']} | {r['rows']}x{r['K']} | {r['N']} | "
                     f"{r['m']}/{r['n_tile']}/{r['bk']}/{r['stages']}/{r['warps']} | {r['us']:.1f} | {r['tbps']:.2f} | "
                     f"{r['tflops']:.1f} | {r['x_cublas']:.2f} ({r['cublas_us']:.1f}) | {r['copy_frac']:.2f} | "
                     f"{r['vs_gemv']:.2f} ({r['gemv_us']:.1f}) | "
                     f"{'' if r['vs_n1'] is None else format(r['vs_n1'], '.2f')} |")
    return "\n".join(lines)


def compile_sm90(configs=None, keep_ptx=False) -> dict:
    """The probe kernel compiled for sm_90 (no GPU; pointers 16-byte aligned, as at a launch) at a decode and a
    prefill tile of the 8B's gate+up: shared memory, registers and spills (the bundled ``ptxas -v``), the MMA
    instructions (``wgmma`` / ``mma.sync``) and async copies in its PTX."""
    import os
    import re
    import subprocess
    import tempfile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from bench.ptx_diff import triton_tool
    configs = configs or {"decode16": dict(K=4096, M=32, N_TILE=16, BK=512, STAGES=5, warps=8),
                          "decode32": dict(K=4096, M=32, N_TILE=32, BK=512, STAGES=4, warps=8),
                          "prefill128": dict(K=4096, M=128, N_TILE=128, BK=64, STAGES=4, warps=8)}
    sig = {"w_ptr": "*bf16", "xt_ptr": "*bf16", "yt_ptr": "*bf16", "m_rows": "i32", "n": "i32",
           "xs": "i32", "ys": "i32"}
    aligned = {(k,): [["tt.divisibility", 16]] for k, (nm, ty) in enumerate(sig.items())
               if ty.startswith("*") or nm in ("xs", "ys")}
    out = {}
    for name, c in configs.items():
        c = dict(c)
        warps = c.pop("warps")
        cx = {**dict(TWO=False, EVEN=True, INTERP=False), **c}
        names = rows_gemm_kernel.arg_names
        s = {k: sig.get(k, "constexpr") for k in names}
        ck = triton.compile(ASTSource(fn=rows_gemm_kernel, signature=s,
                                      constexprs={(names.index(k),): v for k, v in cx.items()}, attrs=aligned),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        ptx = ck.asm["ptx"]
        with tempfile.TemporaryDirectory() as d:
            f = pathlib.Path(d) / "k.ptx"
            f.write_text(ptx)
            r = subprocess.run([str(triton_tool("ptxas")), "-v", "--gpu-name", "sm_90a", str(f), "-o", os.devnull],
                               capture_output=True, text=True)
        text = r.stdout + r.stderr
        regs = re.search(r"Used (\d+) registers", text)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        out[name] = {"shared": ck.metadata.shared, "registers": int(regs.group(1)) if regs else None,
                     "spill_stores": int(spill.group(1)) if spill else None,
                     "spill_loads": int(spill.group(2)) if spill else None,
                     "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
                     "cp.async": ptx.count("cp.async.cg.shared.global") + ptx.count("cp.async.ca.shared.global"),
                     "evict_first": ptx.count("evict_first")}
        if keep_ptx:
            out[name]["ptx"] = ptx
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.rows_gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1b,8b", help="comma list of 1b, 8b (the presets' layer GEMMs)")
    ap.add_argument("--n", default="1,16,32,128,512,2048", help="comma list of N (rows of the step)")
    for k in ("m", "n-tile", "bk", "stages", "warps"):
        ap.add_argument(f"--{k}", type=int, default=None, help=f"the tile's {k} for every N (default: by N, see "
                        "tile_config)")
    ap.add_argument("--reps", type=int, default=20, help="timed launches a measurement (>= 20)")
    ap.add_argument("--out", default=None, help="a directory for rows_gemm.json")
    ap.add_argument("--compile", action="store_true", help="no GPU: compile for sm_90, print JSON")
    a = ap.parse_args(argv)
    if a.compile:
        print(json.dumps(compile_sm90()))
        return 0
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in PRESETS]
    if bad or not shapes:
        ap.error(f"--shapes: unknown {bad}; known: {', '.join(PRESETS)}")
    try:
        ns = [int(v) for v in a.n.split(",") if v]
    except ValueError:
        ap.error(f"--n must be a comma list of ints, got {a.n!r}")
    if not ns or min(ns) < 1:
        ap.error(f"--n values must be >= 1, got {a.n!r}")
    if a.reps < 20:
        ap.error(f"--reps must be >= 20, got {a.reps}")
    if not torch.cuda.is_available():
        ap.error("a GPU is needed (use --compile without one)")
    opts = dict(m=a.m, n_tile=a.n_tile, bk=a.bk, stages=a.stages, warps=a.warps)
    run(shapes, ns, a.reps, opts, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
