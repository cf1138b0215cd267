"""(bench/NOTES.md run 64) Does one SM's pipeline ramp per tile go away when consecutive tiles share one pipelined loop?  python3 -m bench.probes.flat_probe (a GPU)
gemv_drain: a loop per tile (the megakernel today: the pipeline drains between instructions);
gemv_flat : one loop over every block of the SM's REPS tiles (loads of tile t+1 issued while
            tile t finishes), the sum and store at each tile's last block."""
import statistics

import torch
import triton
import triton.language as tl

from bench.probes.stream_probe import gemv_ptr as gemv_drain      # a loop per tile


@triton.jit
def gemv_flat(w_ptr, x_ptr, out_ptr, REPS, NPROG, K: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr,
              STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    NK: tl.constexpr = K // BK
    acc = tl.zeros([ROWS, BK], dtype=tl.float32)
    for it in tl.range(0, REPS * NK, num_stages=STAGES):
        r = it // NK
        kb = it % NK
        t = r * NPROG + pid
        base = w_ptr + t.to(tl.int64) * ROWS * K
        cols = kb * BK + tl.arange(0, BK)
        xv = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
        w = tl.load(base + rows[:, None] * K + cols[None, :], eviction_policy="evict_first")
        acc += w.to(tl.float32) * xv[None, :]
        if kb == NK - 1:
            tl.store(out_ptr + t * ROWS + rows, tl.sum(acc, 1))
            acc = tl.zeros([ROWS, BK], dtype=tl.float32)


def main():
    dev = "cuda"
    K, reps = 2048, 12
    w = torch.randn((1 << 30) // 2, device=dev, dtype=torch.bfloat16)
    x = torch.randn(K, device=dev, dtype=torch.bfloat16)
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    for nprog, rows, bk, st in [(132, 16, 512, 5), (64, 32, 512, 5), (96, 32, 512, 5), (128, 32, 512, 5),
                                (128, 64, 256, 5)]:
        tile = rows * K * 2
        ww = w[: reps * nprog * tile // 2]
        out = torch.empty(reps * nprog * rows, device=dev, dtype=torch.float32)
        ref = (ww.view(-1, K).float() @ x.float()).view(-1)
        for name, fn in [("drain", gemv_drain), ("flat", gemv_flat)]:
            fn[(nprog,)](ww, x, out, reps, nprog, K=K, ROWS=rows, BK=bk, STAGES=st, num_warps=8)
            torch.cuda.synchronize()
            err = (out - ref).abs().max().item() / ref.abs().max().item()
            ts = []
            for _ in range(15):
                e0.record(); fn[(nprog,)](ww, x, out, reps, nprog, K=K, ROWS=rows, BK=bk, STAGES=st, num_warps=8)
                e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1) * 1e3)
            per = statistics.median(ts) / reps
            print(f"{name:5s} nprog {nprog:3d} tile {tile // 1024:4d} KB bk {bk} st {st}: {per:6.2f} us/tile "
                  f"({tile / per / 1e3:5.1f} GB/s/SM, chip {nprog * tile / per / 1e6:5.2f} TB/s) err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
