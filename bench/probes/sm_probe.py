"""Do some SMs stream the 1B's gate/up rows faster than others, every time, and would shares sized to them
end the stage sooner?   python3 -m bench.probes.sm_probe   (a GPU)

Run 219's profile: with each row summed inside one warp (``Tiling.warp_rows``) the gate/up tiles' times
follow the SM that runs them (the same SMs ~10% faster in every layer, ``bench.records --per-sm``: r 0.96).
This probe runs the decoder's gate/up stage (its loop, ``opcodes.common.warp_rows_dot``: 4 rows of gate and
of up a 32 KB stage) on 132 programs, 16 layers of distinct weights, a grid barrier after each, every
program recording its SM (``%smid``) and each layer's time. Three launches of the same stage:

    equal    the decoder's shares (2048 blocks of 4 rows: 68 programs take 16, 64 take 15)
    rotated  the same shares one program over (program p streams what p + 1 did), so a fast program
             given a large share shows whether the rate follows the SM or the rows
    weighted shares in proportion to each program's rate measured under ``equal``

It prints whether each program ran on the same SM in every launch, the correlation of the programs' rates
(rows a us) between ``equal`` and ``rotated``, and the synced stage time of ``equal`` and ``weighted``
alternated. Outputs are checked against torch before timing.
"""
from __future__ import annotations

import os
import statistics
import sys

import torch
import triton
import triton.language as tl

from bench.baselines import stream_copy_bandwidth
from bench.probes.stage_probe import _barrier
from bench.records import corr
from interp.sync import clock_ns
from opcodes.common import store_in_place, warp_rows_dot

D, FFN, LAYERS, RB, STAGES, WARPS, NPROG = 2048, 8192, 16, 4, 5, 4, 132


@triton.jit
def _smid(x):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def sm_kernel(g_ptr, u_ptr, x_ptr, out_ptr, cnt_ptr, rec_ptr, first_ptr, nblk_ptr, NPROG,
              K: tl.constexpr, NROWS: tl.constexpr, LAYERS: tl.constexpr, RB: tl.constexpr, STAGES: tl.constexpr,
              SPIN: tl.constexpr, INTERP: tl.constexpr):
    # program p streams blocks [first[p], first[p] + nblk[p]) of RB rows of gate and up in every layer;
    # rec[p] = [smid, ns of layer 0, ..., ns of layer LAYERS - 1]
    pid = tl.program_id(0)
    first = tl.load(first_ptr + pid)
    nb = tl.load(nblk_ptr + pid)
    if INTERP:
        sm = pid
    else:
        sm = _smid(pid)
    tl.store(rec_ptr + pid * (LAYERS + 1), sm.to(tl.int64))
    hv = tl.load(x_ptr + tl.arange(0, K // 256)[:, None] * 256 + tl.arange(0, 256)[None, :])
    for layer in range(LAYERS):
        t0 = clock_ns(INTERP)
        for b in tl.range(0, nb, num_stages=STAGES):
            rows = layer * NROWS + (first + b) * RB + tl.arange(0, RB)
            rm = rows >= 0
            v = warp_rows_dot(g_ptr, rows.to(tl.int64), rm, hv, K, True)
            uv = warp_rows_dot(u_ptr, rows.to(tl.int64), rm, hv, K, True)
            store_in_place(out_ptr + rows, v / (1.0 + tl.exp(-v)) * uv, rm, INTERP)
        tl.store(rec_ptr + pid * (LAYERS + 1) + 1 + layer, clock_ns(INTERP) - t0)
        if not INTERP:      # the interpreter runs the programs one after another: no barrier there
            _barrier(cnt_ptr, (layer + 1) * NPROG, SPIN)


def equal_shares(nblk: int, nprog: int) -> list[int]:
    """Blocks a program, the decoder's split (``GateUp.spans``): the first ``nblk % nprog`` take one more."""
    q, r = divmod(nblk, nprog)
    return [q + (p < r) for p in range(nprog)]


def weighted_shares(nblk: int, rates: list[float]) -> list[int]:
    """Blocks a program in proportion to ``rates``, rounded so they sum to ``nblk`` (largest remainders)."""
    tot = sum(rates)
    exact = [nblk * r / tot for r in rates]
    out = [int(e) for e in exact]
    for p in sorted(range(len(rates)), key=lambda p: exact[p] - out[p], reverse=True)[:nblk - sum(out)]:
        out[p] += 1
    return out


class Stage:
    """The gate/up stage over ``nprog`` programs, ``layers`` layers of distinct weights."""

    def __init__(self, dev: str, nprog: int = NPROG, layers: int = LAYERS, ffn: int = FFN, d: int = D):
        self.dev, self.nprog, self.layers, self.ffn, self.d = dev, nprog, layers, ffn, d
        self.g = torch.randn(layers * ffn, d, device=dev, dtype=torch.bfloat16)
        self.u = torch.randn(layers * ffn, d, device=dev, dtype=torch.bfloat16)
        self.x = torch.randn(d, device=dev) / d ** 0.5
        self.out = torch.empty(layers * ffn, device=dev)
        self.cnt = torch.zeros(1, device=dev, dtype=torch.int32)
        self.rec = torch.zeros(nprog, layers + 1, device=dev, dtype=torch.int64)
        self.nblk = ffn // RB

    def shares(self, shares: list[int]) -> tuple:
        """The launch's (first, count) device tensors for ``shares`` blocks a program (contiguous, in program
        order), made before any timed window."""
        if len(shares) != self.nprog or sum(shares) != self.nblk or min(shares) < 0:
            raise ValueError(f"shares: {self.nprog} counts >= 0 summing to {self.nblk}, got {len(shares)} "
                             f"summing to {sum(shares)}")
        first = [0]
        for n in shares[:-1]:
            first.append(first[-1] + n)
        return (torch.tensor(first, dtype=torch.int32, device=self.dev),
                torch.tensor(shares, dtype=torch.int32, device=self.dev))

    def run(self, sh: tuple, fresh: bool = False) -> torch.Tensor:
        """One launch with the shares ``sh`` (:meth:`shares`); returns rec."""
        first, nb = sh
        if fresh:
            self.out.fill_(float("nan"))
        self.cnt.zero_()
        sm_kernel[(self.nprog,)](self.g, self.u, self.x, self.out, self.cnt, self.rec, first, nb, self.nprog,
                                 K=self.d, NROWS=self.ffn, LAYERS=self.layers, RB=RB, STAGES=STAGES, SPIN=1 << 22,
                                 INTERP=os.environ.get("TRITON_INTERPRET") == "1", num_warps=WARPS)
        return self.rec

    def check(self) -> float:
        ref = torch.nn.functional.silu(self.g.float() @ self.x) * (self.u.float() @ self.x)
        err = ((self.out - ref).abs().max() / ref.abs().max()).item()
        if not err < 1e-2:      # NaN (a row no program stored) fails too
            raise AssertionError(f"sm_probe: max rel err {err:.2e}")
        return err


def rates(rec: torch.Tensor, shares: list[int]) -> list[float]:
    """Rows a us per program: its rows over its median layer time."""
    ns = rec[:, 1:].float().median(dim=1).values.tolist()
    return [RB * s / (t / 1e3) if t > 0 else 0.0 for s, t in zip(shares, ns)]


def main(argv=None) -> int:
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    dev, reps = "cuda", int(os.environ.get("REPS", "9"))
    bw = stream_copy_bandwidth(dev, nbytes=512 * 1024**2)
    st = Stage(dev)
    eq = equal_shares(st.nblk, NPROG)
    rot = eq[1:] + eq[:1]
    dev_eq, dev_rot = st.shares(eq), st.shares(rot)
    st.run(dev_eq, fresh=True); torch.cuda.synchronize(); st.check()
    recs = {"equal": [], "rotated": []}
    for _ in range(3):
        recs["equal"].append(st.run(dev_eq).clone()); torch.cuda.synchronize()
        recs["rotated"].append(st.run(dev_rot).clone()); torch.cuda.synchronize()
    sms = [r[:, 0].tolist() for rs in recs.values() for r in rs]
    same = sum(all(s[p] == sms[0][p] for s in sms) for p in range(NPROG))
    re_ = [statistics.fmean(v) for v in zip(*[rates(r, eq) for r in recs["equal"]])]
    rr = [statistics.fmean(v) for v in zip(*[rates(r, rot) for r in recs["rotated"]])]
    print(f"stream copy {bw / 1e12:.3f} TB/s; gate/up stage, {NPROG} programs, {LAYERS} layers")
    print(f"programs on the same SM in all {len(sms)} launches: {same} / {NPROG}; SM ids {min(sms[0])}..{max(sms[0])}")
    print(f"rows a us a program, equal: mean {statistics.fmean(re_):.3f} min {min(re_):.3f} max {max(re_):.3f}; "
          f"corr(equal, rotated) by program {corr(re_, rr):.3f}")
    order = sorted(range(NPROG), key=lambda p: re_[p])
    print("slowest programs (p:sm:rows/us):", " ".join(f"{p}:{sms[0][p]}:{re_[p]:.2f}" for p in order[:8]))
    print("fastest programs (p:sm:rows/us):", " ".join(f"{p}:{sms[0][p]}:{re_[p]:.2f}" for p in order[-12:]))
    wt = weighted_shares(st.nblk, re_)
    print(f"weighted shares: {min(wt)}..{max(wt)} blocks a program (equal {min(eq)}..{max(eq)})")
    dev_wt = st.shares(wt)
    st.run(dev_wt, fresh=True); torch.cuda.synchronize(); st.check()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    times = {"equal": [], "weighted": []}
    inner = {"equal": [], "weighted": []}
    for _ in range(reps):
        for name, sh in (("equal", dev_eq), ("weighted", dev_wt)):
            e0.record(); rec = st.run(sh); e1.record(); torch.cuda.synchronize()
            times[name].append(e0.elapsed_time(e1) * 1e3 / LAYERS)
            # the slowest program's loop a layer, median over layers (the stage's end without the barrier)
            inner[name].append(rec[:, 1:].float().max(dim=0).values.median().item() / 1e3)
    nbytes = 2 * FFN * D * 2
    for name, t in times.items():
        us = statistics.median(t)
        print(f"{name:8s}: {us:6.2f} us a synced stage ({nbytes / us / 1e6:5.2f} TB/s; {nbytes / bw * 1e6:5.2f} us at copy "
              f"BW; min {min(t):6.2f} max {max(t):6.2f}); the slowest program's loop {statistics.median(inner[name]):6.2f} us",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
