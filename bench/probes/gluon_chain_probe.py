"""chain_probe's chain of dependent one-wave GEMV stages, streamed by a warp-specialized TMA loader
(Gluon), against chain_probe's `per_tile` and `flat` Triton kernels in the same process.

    python3 -m bench.probes.gluon_chain_probe [stages...] [--gap-us G] [--halves] [--plan chain|decoder]
        (a GPU (H200); default 5; ring min(stages, 6))
    python3 -m bench.probes.gluon_chain_probe --compile [RING [DIR]] [--gap-us G]   (no GPU: sm_90 offline)

``--halves``: also ``ws``'s two halves alone, in the same alternation: ``ws_no_tma`` (the consumer at
its own pace: the loader copies nothing and marks each free slot ready at once) and ``ws_no_math`` (the
loader and the HBM at theirs: the consumer frees each slot unread, but still polls each tile's wait and
stages its vector) and ``ws_loader`` (the loader and the HBM alone: no polls, no vector, each slot freed
unread: the pace a loader partition could keep); their counters and waits are checked, not their sums.
Whichever half is as slow as ``ws`` bounds it.

``--plan decoder``: the stages cut into the 1B decoder's tiles (chain_probe.DECODER_STAGES: QKV 96 tiles
of 32 rows, O 128 of 16, gate/up ragged on all 132 SMs, down 128 tiles of 16 x 8192) instead of
chain_probe's equal tiles (STAGE_SHAPES: O 64, gate/up 128, down 128 of 32 x 4096); the same bytes.

``--gap-us G``: after every layer's QKV stage each O tile spins G us after its wait (chain_probe.gaps),
as the 1B's attention sits between QKV and O (~6 us a layer of idle HBM, run 137): ``per_tile`` idles
through it, ``flat`` has ``STAGES - 1`` blocks in flight across it, ``ws``'s loader fills its ring.

The workload, the plan, the counters and the epoch scheme are chain_probe's (`cp.plan`: the 1B's QKV /
O / gate-up / down per layer, 16 layers, tile i of a stage on SM i, each tile's first block waiting
for every tile of the stage before, its last block releasing its own stage's counter; per-call
targets multiplied by the call number, so the counters are never reset). What differs is the loop's
shape, the one the published megakernels use and Triton cannot express:

    ws : one persistent CTA per SM (grid = SMs, all co-resident), split by `gl.warp_specialize` into
         a loader partition (1 warp, 24 registers) that walks the SM's whole queue of blocks and
         issues the TMA loads of each block into a ring of RING shared-memory slots, waiting only
         for free slots (an `empty` mbarrier per slot), never on the cross-CTA counters (weights do
         not depend on them); and the consumer (the default partition, 4 warps) that, at a tile's
         first block, polls the previous stage's counter (acquire, bounded: on giving up it bumps
         the error word and goes on) and stages the whole vector (4096 fp32, `.cg`, after the wait)
         in shared memory, then for every block reads its slice from there (one L2 round trip a
         tile: read from global for every block, run 122 measured ws at 1.94x the floor), waits for
         the slot's `ready` mbarrier (TMA transaction bytes), multiplies
         the [16, 1024] bf16 block from shared memory by the slice into a [16, 256] fp32 register
         accumulator, releases the slot (fence.proxy.async, a partition barrier, one arrive on
         `empty`), stores the row group's 16 sums at its last block and releases the stage counter
         at the tile's last (a partition barrier, then one atomic_add(sem="release", scope="gpu")).

A block is chain_probe's (16 rows x 1024 columns of bf16 = 32 KB, block j at element j * 16384, so
the weights are a [blocks * 16, 1024] row-major matrix). TMA boxes are at most 256 elements a
dimension, so a block is 4 boxes of [16, 256], all four counted on the slot's one `ready` barrier
(expect 32768 bytes). No swizzle: a box is 16 rows of 512 contiguous bytes, and the consumer's warps
each read whole rows, 16 bytes a thread, which is conflict-free without one (`gl.bank_conflicts`
asserts 0 when the kernel compiles); a 128-byte swizzle would clamp the box to [16, 64], 16 TMA
messages a block instead of 4. A ring slot is [4, 16, 256] bf16; RING slots (default 5, at most 6:
6 x 32 KB + the 16 KB vector + the barriers fit the H200's 227 KB) take RING x 32 KB of shared memory. Launch:
num_warps=4 (the consumer; the loader's warp adds a warp group: 256 threads), maxnreg=128 (32K
registers a CTA; `setmaxnreg` moves the loader's group to 24 and the consumer's to 232). Unlike
chain_probe's `flat`, which streams the vector with the weights (before the wait), this reads it
after the wait, as a real kernel must (chain_probe's `rows_flat` does too).

Outputs are checked against an fp32 torch reference of the same chain (`reference`) and the error
word and counters after one call, before any timing; then the variants are timed alternated
(`per_tile`, `flat`, `ws`, then reversed), medians of `steps` calls each after two warm-up calls.
The floor is the weights' bytes over the stream-copy bandwidth measured in the same run.

Offline (`--compile`): the kernel compiled for sm_90 with the launch's options and the signature the
runtime would give the launch's arguments (tests/test_probes.py checks it, with TRITON_INTERPRET
unset); prints JSON (shared memory, ptxas registers / spills) and writes the PTX and TTGIR to DIR.

Measured (runs 122-125, H200; bench/NOTES.md "Gluon probe outcome"): ws is correct, and with the
vector staged once a tile 40.4-42.4 us a layer at ring 6 / 5 against per_tile's 43.9-44.1 and flat's
35.3-36.5 (rows_flat, run 93: 40.4-41.5); 8 consumer warps (GLUON_WS_WARPS=8) are no faster.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bench.probes import chain_probe as cp

ROWS_, COLS_ = cp.ROWS_, cp.COLS_   # chain_probe's block: 16 x 1024 bf16 = 32 KB
BOX_ = 256                          # a TMA box: [16, 256] (TMA's limit is 256 elements a dimension)
NSUB_ = COLS_ // BOX_               # boxes per block
BLOCK_BYTES_ = ROWS_ * COLS_ * 2
MAX_RING = 6                        # 6 x 32 KB + the 16 KB vector + barriers fit 232448 bytes (an H200 block's maximum)
BR, BK, BOX, NSUB = gl.constexpr(ROWS_), gl.constexpr(COLS_), gl.constexpr(BOX_), gl.constexpr(NSUB_)
BLOCK_BYTES = gl.constexpr(BLOCK_BYTES_)
#: halves of the ws pipeline timed alone (``chain_ws``'s MODE; their sums are wrong, their counters right):
#: NO_TMA, the consumer alone (the loader copies nothing and marks each free slot ready at once: the
#: consumer's waits, vector, shared-memory dots and signals at their own pace); NO_MATH, the loader and
#: the HBM alone (the consumer waits for each slot and frees it without reading it)
NO_TMA_, NO_MATH_ = 1, 2
NO_TMA, NO_MATH = gl.constexpr(NO_TMA_), gl.constexpr(NO_MATH_)
#: LOADER, the loader and the HBM alone without the consumer's polls and vector (NO_MATH still polled the
#: previous stage's counter and staged the vector at each tile, so its "loader alone" was paced by the chain:
#: issue 53); the consumer waits for each slot, frees it unread, and releases its tile's counter
LOADER_ = 3
LOADER = gl.constexpr(LOADER_)
#: the launch's options (the offline compile uses the same)
#: GLUON_WS_WARPS=8: 8 consumer warps (12 with the loader's group: 168 registers a thread); run 125: no faster
_W = os.environ.get("GLUON_WS_WARPS", "4")
if _W not in ("4", "8"):
    raise ValueError(f"GLUON_WS_WARPS={_W!r}: 4 or 8 consumer warps")
LAUNCH = dict(num_warps=int(_W), maxnreg=128 if _W == "4" else 168)
#: the weights' shared layout: no swizzle, so a [16, 256] box is 16 rows of 512 contiguous bytes
SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


@gluon.jit
def _row(tab_ptr, j, ok):
    # table row j's wait counter, its per-call target, out index, signal counter (-1: none; ok False: none)
    e = tab_ptr + j * 6
    return (gl.load(e + 2, mask=ok, other=-1).to(gl.int32), gl.load(e + 3, mask=ok, other=0).to(gl.int32),
            gl.load(e + 4, mask=ok, other=-1).to(gl.int32), gl.load(e + 5, mask=ok, other=-1).to(gl.int32))


@gluon.jit
def _loader(w_desc, bufs, ready, empty, b0, b1, RING: gl.constexpr, MODE: gl.constexpr):
    # 1 warp: every block of the SM's queue into the ring, in order; waits only for a free slot
    # (MODE 1, NO_TMA: a slot is "ready" as soon as it is free, nothing is copied)
    s = 0
    ph = 0
    for j in range(b0, b1):
        mbarrier.wait(empty.index(s), ph ^ 1)     # a fresh barrier passes parity 1: the first lap never waits
        if MODE == NO_TMA:
            mbarrier.arrive(ready.index(s))
        else:
            mbarrier.expect(ready.index(s), BLOCK_BYTES)
            for c in gl.static_range(NSUB):
                tma.async_copy_global_to_shared(w_desc, [j * BR, c * BOX], ready.index(s), bufs.index(s * NSUB + c))
        s += 1
        if s == RING:
            s = 0
            ph ^= 1


@gluon.jit
def _consumer(tab_ptr, x_ptr, out_ptr, cnt_ptr, err_ptr, epoch, b0, b1, bufs, xs, ready, empty, gap_ptr,
              RING: gl.constexpr, L: gl.constexpr, GAP: gl.constexpr, MODE: gl.constexpr):
    # the default partition (4 warps): waits, vector, multiply-accumulate from shared memory, stores, signals
    gl.static_assert(NSUB == 4)
    rows = gl.arange(0, BR, layout=gl.SliceLayout(1, L))
    # the whole vector (4 x 1024 fp32: row r * NSUB + c of xs is x[r * 1024 + c * 256:][:256]) staged in
    # shared memory once a tile, after its wait: one L2 round trip a tile, not one a block
    xo = gl.arange(0, 4 * NSUB, layout=gl.SliceLayout(1, L))[:, None] * BOX + \
        gl.arange(0, BOX, layout=gl.SliceLayout(0, L))[None, :]
    xr = xs._reinterpret(gl.float32, [4 * NSUB, BOX], gl.SwizzledSharedLayout(1, 1, 1, [0]))    # rows indexable
    acc = gl.zeros([BR, BOX], gl.float32, L)
    s = 0
    ph = 0
    wc, tg, oi, sc = _row(tab_ptr, b0, b0 < b1)
    for j in range(b0, b1):
        nwc, ntg, noi, nsc = _row(tab_ptr, j + 1, j + 1 < b1)     # the next block's row, a block early
        if MODE != LOADER:
            if wc >= 0:                                              # a tile's first block
                cp._wait(cnt_ptr, err_ptr, wc, tg * epoch)     # chain_probe's bounded acquire poll (a @triton.jit helper)
                if GAP:                              # the counter's gap (chain_probe.gaps): nothing streams but the loader
                    cp._gap_on(gap_ptr, wc, False)
            if (wc >= 0) | (j == b0):                                # a tile's first block (the chain's first: no wait)
                xs.store(gl.load(x_ptr + xo, cache_modifier=".cg"))
                gl.thread_barrier()     # the previous tile's readers passed its last block's barrier; these stores are seen
        if (MODE == NO_MATH) | (MODE == LOADER):
            mbarrier.wait(ready.index(s), ph)
        else:
            r = (j % 4) * NSUB                                       # chain_probe's x[(j % 4) * 1024:][:1024]
            x0 = xr.index(r).load(gl.SliceLayout(0, L))
            x1 = xr.index(r + 1).load(gl.SliceLayout(0, L))
            x2 = xr.index(r + 2).load(gl.SliceLayout(0, L))
            x3 = xr.index(r + 3).load(gl.SliceLayout(0, L))
            mbarrier.wait(ready.index(s), ph)
            w0 = bufs.index(s * NSUB).load(L)
            gl.static_assert(gl.bank_conflicts(w0.type, bufs.index(0).type) == 0)    # checked when compiled
            acc += w0.to(gl.float32) * x0[None, :]
            acc += bufs.index(s * NSUB + 1).load(L).to(gl.float32) * x1[None, :]
            acc += bufs.index(s * NSUB + 2).load(L).to(gl.float32) * x2[None, :]
            acc += bufs.index(s * NSUB + 3).load(L).to(gl.float32) * x3[None, :]
        fence_async_shared()        # the generic-proxy reads before the next TMA (async proxy) write
        gl.thread_barrier()         # every consumer warp has read the slot
        mbarrier.arrive(empty.index(s))
        if oi >= 0:                                                  # a row group's last block
            gl.store(out_ptr + oi * BR + rows, gl.sum(acc, 1))
            acc = gl.zeros([BR, BOX], gl.float32, L)
        if sc >= 0:                                                  # a tile's last block
            gl.thread_barrier()
            gl.atomic_add(cnt_ptr + sc, 1, sem="release", scope="gpu")
        s += 1
        if s == RING:
            s = 0
            ph ^= 1
        wc, tg, oi, sc = nwc, ntg, noi, nsc


@gluon.jit(do_not_specialize=["epoch"])
def chain_ws(tab_ptr, start_ptr, x_ptr, w_desc, out_ptr, cnt_ptr, err_ptr, epoch, gap_ptr, RING: gl.constexpr,
             GAP: gl.constexpr, MODE: gl.constexpr = 0):
    NW: gl.constexpr = gl.num_warps()
    # a [16, 256] box read 8 bf16 (16 bytes) a thread, a warp per 512-byte row
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    pid = gl.program_id(0)
    b0 = gl.load(start_ptr + pid).to(gl.int32)       # this SM's blocks [b0, b1)
    b1 = gl.load(start_ptr + pid + 1).to(gl.int32)
    bufs = gl.allocate_shared_memory(w_desc.dtype, [RING * NSUB, BR, BOX], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    xs = gl.allocate_shared_memory(gl.float32, [4 * NSUB, BOX], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for i in gl.static_range(RING):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (tab_ptr, x_ptr, out_ptr, cnt_ptr, err_ptr, epoch, b0, b1, bufs, xs, ready, empty, gap_ptr, RING, L,
                     GAP, MODE)),
        (_loader, (w_desc, bufs, ready, empty, b0, b1, RING, MODE)),
    ], [1], [24])
    for i in gl.static_range(RING):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def make_desc(w: torch.Tensor) -> TensorDescriptor:
    """The TMA descriptor of chain_probe's packed weights (block j at element j * 16384) as a
    [blocks * 16, 1024] bf16 matrix, [16, 256] boxes."""
    return TensorDescriptor.from_tensor(w.view(-1, COLS_), [ROWS_, BOX_], SMEM_LAYOUT)


def launch_ws(tables, x, desc, out, cnt, err, epoch, sms, ring, gap=None, mode=0):
    """``gap``: chain_probe.gaps' per-counter nanoseconds (int64 on the device), or None (no gap code);
    ``mode``: 0, or one half of the pipeline alone (:data:`NO_TMA`, :data:`NO_MATH`: wrong sums)."""
    if not 1 <= ring <= MAX_RING:
        raise ValueError(f"ring {ring}: 1..{MAX_RING} slots of 32 KB fit an H200 block's shared memory")
    if mode not in (0, NO_TMA_, NO_MATH_, LOADER_):
        raise ValueError(f"mode {mode!r}: 0, NO_TMA ({NO_TMA_}), NO_MATH ({NO_MATH_}) or LOADER ({LOADER_})")
    tab_t, start_t = tables[0], tables[1]
    chain_ws[(sms,)](tab_t, start_t, x, desc, out, cnt, err, epoch, tab_t if gap is None else gap, RING=ring,
                     GAP=int(gap is not None), MODE=mode, **LAUNCH)


def reference(tab, w: torch.Tensor, x: torch.Tensor, nout: int, chunk: int = 4096) -> torch.Tensor:
    """fp32 torch sums of cp.plan's chain from the table alone: block j (table row r: weights at
    w[r[0]:] as [16, 1024], vector x[r[1]:][:1024]) summed over its row group's blocks, stored at
    out[r[4] * 16:][:16] of the group's last block. [nout * 16] fp32 on w's device."""
    dev = w.device
    t = torch.as_tensor(tab, dtype=torch.int64).to(dev).view(-1, 6)
    nb = t.shape[0]
    ar = torch.arange(nb, device=dev)
    if not torch.equal(t[:, 0], ar * (ROWS_ * COLS_)):
        raise ValueError("the weights are not packed in table order (block j at j * 16384): not cp.plan's")
    last = torch.nonzero(t[:, 4] >= 0).flatten()                  # every row group's last block
    grp = t[last[torch.searchsorted(last, ar)], 4]                 # each block's output row group
    w3 = w[:nb * ROWS_ * COLS_].view(nb, ROWS_, COLS_)
    xf = x.float()
    ref = torch.zeros(nout, ROWS_, dtype=torch.float32, device=dev)
    cols = torch.arange(COLS_, device=dev)
    for a in range(0, nb, chunk):
        b = min(nb, a + chunk)
        xs = xf[t[a:b, 1:2] + cols]                                # [chunk, 1024]
        ref.index_add_(0, grp[a:b], (w3[a:b].float() * xs[:, None, :]).sum(-1))   # no matmul: no TF32
    return ref.flatten()


def signals_per_call(tab, ncnt: int) -> torch.Tensor:
    """How many tiles release each counter in one call (a stage's tiles: its counter's per-call rise)."""
    sc = torch.as_tensor(tab, dtype=torch.int64).view(-1, 6)[:, 5]
    return torch.bincount(sc[sc >= 0], minlength=ncnt).to(torch.int32)


def check(name, out, cnt, err, calls, ref, per_call, tol=1e-4) -> float:
    """After ``calls`` calls of a variant: no wait gave up, every counter rose by its stage's tiles per
    call, the outputs are the reference's (fp32, rtol = atol = tol; ``ref`` None: not compared, 0.0
    returned). Returns the largest difference."""
    if int(err.item()):
        raise RuntimeError(f"{name}: {int(err.item())} waits gave up")
    if not torch.equal(cnt.cpu(), per_call.cpu() * calls):
        raise RuntimeError(f"{name}: counters {cnt.cpu().tolist()[:8]}... after {calls} calls, expected "
                           f"{(per_call.cpu() * calls).tolist()[:8]}... (each tile signals once a call)")
    if ref is None:
        return 0.0
    diff = (out - ref).abs().max().item()
    if not torch.allclose(out, ref, rtol=tol, atol=tol):
        raise RuntimeError(f"{name}: outputs differ from the fp32 reference (max abs diff {diff:.3g})")
    return diff


# ---- offline compile (no GPU) ----------------------------------------------------------------------------
def compile_sm90(ring: int = 5, gap: int = 0, mode: int = 0):
    """chain_ws compiled for sm_90 with LAUNCH's options and the signature the runtime gives the
    launch's arguments (the descriptor's type from a CPU stand-in). Needs TRITON_INTERPRET unset when triton
    is first imported (under it gluon's own @triton.jit helpers, gl.sum's among them, are interpreted
    functions, which the compiler rejects: "Unsupported function referenced: ...InterpretedFunction")."""
    if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
        raise RuntimeError("compile_sm90: unset TRITON_INTERPRET (Gluon kernels are compiled, never interpreted)")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    desc = make_desc(torch.zeros(ROWS_ * COLS_ * 4, dtype=torch.bfloat16))
    sig = {"tab_ptr": "*i64", "start_ptr": "*i64", "x_ptr": "*fp32", "w_desc": mangle_type(desc), "out_ptr": "*fp32",
           "cnt_ptr": "*i32", "err_ptr": "*i32", "epoch": "i32", "gap_ptr": "*i64", "RING": "constexpr",
           "GAP": "constexpr", "MODE": "constexpr"}
    names = chain_ws.arg_names
    src = GluonASTSource(fn=chain_ws, signature={n: sig[n] for n in names},
                         constexprs={(names.index("RING"),): ring, (names.index("GAP"),): gap,
                                     (names.index("MODE"),): mode},
                         attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n][0] == "*"})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(LAUNCH))


def _compile_main(ring: int, out_dir: str | None, gap: int = 0) -> int:
    from bench.ptx_diff import resources
    d = pathlib.Path(out_dir or tempfile.mkdtemp(prefix="gluon_chain_"))
    d.mkdir(parents=True, exist_ok=True)
    ck = compile_sm90(ring, gap)
    (d / "chain_ws.ptx").write_text(ck.asm["ptx"])
    (d / "chain_ws.ttgir").write_text(ck.asm["ttgir"])
    print(json.dumps({"ring": ring, "gap": gap, "shared": ck.metadata.shared, "num_warps": ck.metadata.num_warps,
                      "tensordesc_meta": ck.metadata.tensordesc_meta, "resources": resources(d / "chain_ws.ptx"),
                      "ptx": str(d / "chain_ws.ptx"), "ttgir": str(d / "chain_ws.ttgir")}))
    return 0


# ---- the GPU run ------------------------------------------------------------------------------------------
NAMES = ("per_tile", "flat", "ws")
#: ws's halves alone (``--halves``): wrong sums, counters and waits checked
HALVES = {"ws_no_tma": NO_TMA_, "ws_no_math": NO_MATH_, "ws_loader": LOADER_}
#: ``--plan``: chain_probe's plans (``chain``: its equal tiles, STAGE_SHAPES; ``decoder``: the 1B decoder's tiles,
#: DECODER_STAGES, gate/up ragged on all 132 SMs)
PLANS = {"chain": (cp.plan, cp.STAGE_SHAPES), "decoder": (cp.plan_decoder, cp.DECODER_STAGES)}


def run(device="cuda", layers=16, sms=None, steps=20, stages=5, gap_us=0.0, halves=False, plan="chain"):
    """Every variant checked once against the reference, then timed alternated: ``stages`` is the
    Triton kernels' pipeline depth and the ws ring's slots. ``gap_us`` > 0: after every layer's QKV
    stage each O tile spins that long after its wait (chain_probe.gaps), a phase that streams nothing
    but what a variant loads ahead (the 1B's attention). ``halves``: also ws's consumer alone and its
    loader alone (:data:`HALVES`; counters and waits checked, not their sums). ``plan``: a key of :data:`PLANS`."""
    planner, shapes = PLANS[plan]
    dev = torch.device(device)
    sms = sms or torch.cuda.get_device_properties(dev).multi_processor_count
    ring = min(stages, MAX_RING)
    bw = cp.stream_bw(dev)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)      # noqa: E731
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4096, generator=g).to(dev)
    tab, start, tiles, tstart, nw, nout, ncnt = planner(layers, sms)
    w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16).to(dev)
    tables = (i64(tab).reshape(-1), i64(start), i64(tiles), i64(tstart))
    desc = make_desc(w)
    ref = reference(tab, w, x, nout)
    per_call = signals_per_call(tab, ncnt).to(dev)
    gap = i64(cp.gaps(ncnt, len(shapes), round(gap_us * 1e3))) if gap_us > 0 else None

    names = NAMES + (tuple(HALVES) if halves else ())

    def call(name, out, cnt, err, epoch):
        if name == "ws" or name in HALVES:
            launch_ws(tables, x, desc, out, cnt, err, epoch, sms, ring, gap, HALVES.get(name, 0))
        else:
            cp.launch(name, tables, x, w, out, cnt, err, epoch, sms, stages, gap)

    fresh = lambda: (torch.zeros(nout * ROWS_, dtype=torch.float32, device=dev),       # noqa: E731
                     torch.zeros(ncnt, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev))
    want = lambda name: None if name in HALVES else ref        # noqa: E731  (a half's sums are not compared)
    for name in names:                          # checked (and compiled) before any timing
        out, cnt, err = fresh()
        call(name, out, cnt, err, 1)
        torch.cuda.synchronize()
        diff = check(name, out, cnt, err, 1, want(name), per_call)
        print(f"  {name}: " + ("counters and waits as the chain's (sums not compared)" if name in HALVES else
                               f"matches the fp32 reference (max abs diff {diff:.2e})"))
    res = {}
    for name in names + names[::-1]:
        out, cnt, err = fresh()
        t = cp.timed_median(lambda step: call(name, out, cnt, err, step), steps)
        check(name, out, cnt, err, steps, want(name), per_call)
        res.setdefault(name, []).append(t)
    what = f"{plan} plan, pipeline {stages} (ws: ring of {ring} x 32 KB)"
    if gap is not None:
        what += f"; a {gap_us:g} us gap after each layer's QKV ({layers * gap_us:g} us a call beside the floor)"
    floor_us = cp.report(dev, layers, sms, w.numel() * 2, bw, what, res, 10)
    return res, floor_us


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(args):
        print(__doc__.split("\n\n")[1])
        return 0
    if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
        print("TRITON_INTERPRET is set: Gluon kernels are never interpreted; unset it", file=sys.stderr)
        return 2
    halves = "--halves" in args
    args = [a for a in args if a != "--halves"]
    plan = "chain"
    if "--plan" in args:
        i = args.index("--plan")
        plan = args[i + 1] if i + 1 < len(args) else ""
        if plan not in PLANS:
            print(f"--plan {plan!r}: one of {', '.join(PLANS)}", file=sys.stderr)
            return 2
        args = args[:i] + args[i + 2:]
    gap_us = 0.0
    if "--gap-us" in args:
        i = args.index("--gap-us")
        if i + 1 >= len(args):
            print("--gap-us needs a number of microseconds", file=sys.stderr)
            return 2
        try:
            gap_us = float(args[i + 1])
        except ValueError:
            gap_us = -1.0
        if not gap_us >= 0:
            print(f"--gap-us {args[i + 1]!r}: a gap is a number of microseconds >= 0", file=sys.stderr)
            return 2
        args = args[:i] + args[i + 2:]
    if args[:1] == ["--compile"]:
        return _compile_main(int(args[1]) if len(args) > 1 else 5, args[2] if len(args) > 2 else None, int(gap_us > 0))
    bad = [s for s in args if not s.isdigit() or int(s) < 1]
    if bad:
        print(f"{bad[0]!r}: a pipeline depth is an integer >= 1 (usage: python3 -m bench.probes.gluon_chain_probe "
              "[stages...] [--gap-us G] [--halves] [--plan chain|decoder] | --compile [RING [DIR]])", file=sys.stderr)
        return 2
    for st in [int(s) for s in (args or ["5"])]:
        run(stages=st, gap_us=gap_us, halves=halves, plan=plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
