"""Per-SM streaming probe (bench/NOTES.md run 62): a GEMV tile per program, REPS tiles in sequence (the pipeline drains
between tiles, as in the megakernel), cp.async pointer loads vs TMA descriptor loads.   python3 -m bench.probes.stream_probe (a GPU)
WARPS=4 (default 8): the programs' warps (the 1B decoder's kernel runs 4, the others 8)."""
import os
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def gemv_ptr(w_ptr, x_ptr, out_ptr, REPS, NPROG, K: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr,
             STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    for r in range(REPS):
        t = r * NPROG + pid
        base = w_ptr + t.to(tl.int64) * ROWS * K
        acc = tl.zeros([ROWS, BK], dtype=tl.float32)
        for kk in tl.range(0, K, BK, num_stages=STAGES):
            cols = kk + tl.arange(0, BK)
            xv = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
            w = tl.load(base + rows[:, None] * K + cols[None, :], eviction_policy="evict_first")
            acc += w.to(tl.float32) * xv[None, :]
        tl.store(out_ptr + t * ROWS + rows, tl.sum(acc, 1))


@triton.jit
def gemv_tma(w_ptr, x_ptr, out_ptr, REPS, NPROG, TOTAL_ROWS, K: tl.constexpr, ROWS: tl.constexpr,
             BK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    desc = tl.make_tensor_descriptor(w_ptr, shape=[TOTAL_ROWS, K], strides=[K, 1], block_shape=[ROWS, BK])
    for r in range(REPS):
        t = r * NPROG + pid
        acc = tl.zeros([ROWS, BK], dtype=tl.float32)
        for kk in tl.range(0, K, BK, num_stages=STAGES):
            cols = kk + tl.arange(0, BK)
            xv = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
            w = desc.load([t * ROWS, kk])
            acc += w.to(tl.float32) * xv[None, :]
        tl.store(out_ptr + t * ROWS + rows, tl.sum(acc, 1))


def main():
    dev = "cuda"
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device=dev, dtype=torch.int8))
    K = 2048
    reps = int(os.environ.get("REPS", "12"))
    warps = int(os.environ.get("WARPS", "8"))
    print(f"{warps} warps a program")
    total_bytes_max = 1 << 30
    w = torch.randn(total_bytes_max // 2, device=dev, dtype=torch.bfloat16)
    x = torch.randn(K, device=dev, dtype=torch.bfloat16)
    # stream copy for reference
    a = torch.empty(1 << 28, device=dev, dtype=torch.bfloat16); b = torch.empty_like(a)
    for _ in range(3): b.copy_(a)
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(10):
        e0.record(); b.copy_(a); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    bw = 2 * a.numel() * 2 / (statistics.median(ts) * 1e-3)
    print(f"stream copy {bw / 1e12:.3f} TB/s")
    del a, b
    cases = [(64, 32), (96, 32), (132, 32), (128, 64), (128, 128), (132, 16)]
    for nprog, rows in cases:
        tile = rows * K * 2
        need = reps * nprog * tile
        ww = w[: need // 2]
        out = torch.empty(reps * nprog * rows, device=dev, dtype=torch.float32)
        ref = None
        for name, fn, bk, st in [("ptr", gemv_ptr, 512 if rows <= 32 else 256, 5), ("ptr", gemv_ptr, 256, 6),
                                 ("tma", gemv_tma, 256, 5), ("tma", gemv_tma, 128, 6), ("tma", gemv_tma, 64, 8)]:
            if rows * bk * 2 * st > 200 * 1024:
                continue
            args = (ww, x, out, reps, nprog)
            if name == "tma":
                args += (reps * nprog * rows,)

            def call():          # this configuration, once
                fn[(nprog,)](*args, K=K, ROWS=rows, BK=bk, STAGES=st, num_warps=warps)

            try:
                call()
                torch.cuda.synchronize()
            except Exception as ex:
                print(f"{name} rows {rows} bk {bk} st {st}: FAILED {type(ex).__name__}: {str(ex)[:200]}")
                continue
            if ref is None:
                ref = (ww.view(-1, K).float() @ x.float()).view(-1)
            err = (out - ref).abs().max().item() / ref.abs().max().item()
            ts = []
            for _ in range(15):
                e0.record(); call(); e1.record()
                torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1) * 1e3)
            us = statistics.median(ts)
            per = us / reps
            print(f"{name} nprog {nprog:3d} tile {tile // 1024:4d} KB bk {bk:3d} st {st}: {per:6.2f} us/tile "
                  f"({tile / per / 1e3:5.1f} GB/s/SM, chip {nprog * tile / per / 1e6:5.2f} TB/s; ideal at copy BW "
                  f"{nprog * tile / bw * 1e6:5.2f} us) err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
