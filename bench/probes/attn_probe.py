"""Where the merged attention's time goes once its wait is met: loads, dots, the new key, the signal.
    python3 -m bench.probes.attn_probe [calls]      (a GPU (H200); default 50)
    python3 -m bench.probes.attn_probe --cold       (the attention twice a launch, with other code between)
    python3 -m bench.probes.attn_probe --cold --flush   (... the L2 flushed before each launch: its code from the HBM)
    python3 -m bench.probes.attn_probe --opcode     (ATTN_PARTIAL's own device function, compiled alone)
    python3 -m bench.probes.attn_probe --fresh      (the same, with q and the new key written just before the release)
    python3 -m bench.probes.attn_probe --compile    (no GPU: its kernels compiled for sm_90)

The 1B decoder's short-context attention (`Tiling.attn_splits=1`, `opcodes.attn_partial._attn_whole`)
takes ~3.5 us from its wait met to its signal at pos 128 (runs 237-253), for 32 KB of K/V a KV group
that were loaded before the wait, 4 query rows and one new key. bench/NOTES.md v93-v94 called it a
chain of round trips without timing the links. This probe runs the same code for the 1B's 8 KV groups
(8 programs, one an SM), with a 9th program that releases their counter `DELAY_NS` after it starts (so
the prefix has landed, as in the decoder) and then polls until all 8 have signalled. Each attention
program stamps `%globaltimer`:
    t0  its wait met (the kernel's acquire poll, `opcodes.common.poll_counter`)
    t1  q, the new key and value in its registers                    (stamps: MODE 1 only)
    t2  the prefix block's online softmax done (`_attn_block`)       (MODE 1 only)
    t3  the new key merged, before the store                        (MODE 1 only)
    t4  after its store, the CTA barrier and the release atomic (the kernel's signal)
and the releaser stamps its release and when it saw all 8 signals. A stamp "once x is in registers" is
a clock read that takes x as an operand (it issues when x is ready); its max over the CTA is the stamp.
MODE 0 has only t0 and t4, to show what the stamps themselves cost; MODE 2 stamps t1 once the prefix block's
K and V are in registers too (so t2 - t1 is the block's arithmetic alone). With `pollers` > 0 that many more
programs poll the attention's counter until all 8 have signalled, as the decoder's O tiles do (back to
back, or `sleep_ns` apart with `nanosleep`), and stamp when they see it.
"""
from __future__ import annotations

import math
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from opcodes.attn_partial import _attn_block, _merge_key, _q_scaled, attn_partial_device
from opcodes.common import poll_counter, to_bf16

GROUPS, GROUP, GROUP_PAD, HD = 8, 4, 16, 64            # the 1B: 8 KV heads, 4 query heads each
MAX_SEQ, ATTN_BLOCK, ATTN_STAGES = 256, 128, 3          # bench-decoder's cache at pos 128; the 1B tiling
QSCALE = 1.0 / math.sqrt(HD) * math.log2(math.e)
DELAY_NS = 5000
SPIN = 1 << 22


@triton.jit
def _stamp(x):
    """The clock once every element of fp32 ``x`` ([m, n]) is in its thread's registers (the latest thread)."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x.to(tl.int32, bitcast=True)],
                                  dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(tl.max(t, axis=1), axis=0)


@triton.jit
def _attn_timed(kc, vc, q_ptr, out_ptr, cnt_ptr, times_ptr, pos, NQ: tl.constexpr, HD: tl.constexpr,
                GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, MAX_SEQ: tl.constexpr, QSCALE: tl.constexpr,
                ATTN_BLOCK: tl.constexpr, ATTN_STAGES: tl.constexpr, DELAY: tl.constexpr, MODE: tl.constexpr,
                SLEEP: tl.constexpr = 0):
    # `_attn_whole`'s key loop written out (its stamps go between the loop's steps); its pieces are the opcode's
    # (`_q_scaled`, `_attn_block`, `_merge_key`), and `--opcode` / `--cold` run the opcode's function itself
    g = tl.program_id(0)
    if g > NQ // GROUP:
        # a poller, as the decoder's O tiles wait on the attention's counter: acquire reads until all 8
        # groups have signalled, SLEEP ns apart (0: back to back, the kernel's poll)
        seen = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire", scope="gpu")
        n = 0
        while (seen < NQ // GROUP) & (n < (1 << 22)):
            if SLEEP > 0:
                tl.inline_asm_elementwise(f"nanosleep.u32 {SLEEP};\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                          is_pure=False, pack=1)
            seen = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire", scope="gpu")
            n += 1
        tl.store(times_ptr + (NQ // GROUP + 1) * 8 + g, globaltimer())
    elif g == NQ // GROUP:
        # the releaser: the attention's wait is met DELAY ns after it starts; then it sees their signals
        t = globaltimer()
        t_start = t
        while t - t_start < DELAY:
            t = globaltimer()
        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
        t_rel = globaltimer()
        seen = poll_counter(cnt_ptr + 1, NQ // GROUP, 1 << 22)
        t_seen = globaltimer()
        tl.store(times_ptr + g * 8 + 0, t_rel)
        tl.store(times_ptr + g * 8 + 1, t_seen)
        tl.store(times_ptr + g * 8 + 2, seen.to(tl.int64))
    else:
        hq = tl.arange(0, GROUP_PAD)
        hm = hq < GROUP
        qrow = g * GROUP + hq
        dcol = tl.arange(0, HD)
        kbase = kc + g * (MAX_SEQ * HD)
        vbase = vc + g * (MAX_SEQ * HD)
        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HD], dtype=tl.float32)
        qs = tl.zeros([GROUP_PAD, HD], dtype=tl.bfloat16)
        kn = tl.zeros([HD], dtype=tl.bfloat16)
        vn = tl.zeros([HD], dtype=tl.bfloat16)
        t0 = tl.full([], 0, tl.int64)
        t1 = t0
        t2 = t0
        for kb in tl.range(0, pos, ATTN_BLOCK, num_stages=ATTN_STAGES):
            keys = kb + tl.arange(0, ATTN_BLOCK)
            km = keys < pos
            k = tl.load(kbase + keys[:, None] * HD + dcol[None, :], mask=km[:, None], other=0.0, cache_modifier=".cg")
            v = tl.load(vbase + keys[:, None] * HD + dcol[None, :], mask=km[:, None], other=0.0, cache_modifier=".cg")
            if kb == 0:
                poll_counter(cnt_ptr, 1, 1 << 22)
                t0 = globaltimer()
                qs = _q_scaled(q_ptr, 0, qrow, hm, dcol, NQ, HD, QSCALE, False)
                kn = tl.load(kbase + pos * HD + dcol, cache_modifier=".cg")
                vn = tl.load(vbase + pos * HD + dcol, cache_modifier=".cg")
                if MODE == 1:
                    t1 = tl.maximum(_stamp(qs.to(tl.float32)), _stamp((kn.to(tl.float32) + vn.to(tl.float32))[None, :]))
                if MODE == 2:       # t1 once the prefix block (K and V) is in registers too
                    t1 = tl.maximum(_stamp(qs.to(tl.float32)), _stamp(k.to(tl.float32) + v.to(tl.float32)))
            m_i, l_i, acc = _attn_block(qs, k, v, km, m_i, l_i, acc, False)
            if MODE >= 1:
                t2 = _stamp(acc)
        l_i, acc = _merge_key(qs, kn, vn, m_i, l_i, acc)
        res = acc / l_i[:, None]
        t3 = t0
        if MODE >= 1:
            t3 = _stamp(res)
        tl.store(out_ptr + qrow[:, None] * HD + dcol[None, :], res, mask=hm[:, None])
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + 1, 1, sem="release", scope="gpu")
        t4 = globaltimer()
        tl.store(times_ptr + g * 8 + 0, t0)
        tl.store(times_ptr + g * 8 + 1, t1)
        tl.store(times_ptr + g * 8 + 2, t2)
        tl.store(times_ptr + g * 8 + 3, t3)
        tl.store(times_ptr + g * 8 + 4, t4)


@triton.jit
def _attn_twice(kc, vc, q_ptr, out_ptr, cnt_ptr, times_ptr, wtab_ptr, ins_ptr, pos, NQ: tl.constexpr,
                HD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, MAX_SEQ: tl.constexpr,
                QSCALE: tl.constexpr, ATTN_BLOCK: tl.constexpr, ATTN_STAGES: tl.constexpr, DELAY: tl.constexpr,
                BLOB: tl.constexpr):
    # Is the attention's code cold after other code? Each attention program runs the opcode's device function
    # twice in one launch (a loop the compiler keeps: the same machine code both times), rep r as call r + 1
    # (its wait's target r + 1: the releaser's r-th release); with BLOB > 0 it first runs BLOB distinct
    # straight-line steps (8 FFMA, 128 B of code each), as the decoder's SMs run O, GATE_UP and DOWN between
    # two attentions
    g = tl.program_id(0)
    NG: tl.constexpr = NQ // GROUP
    if g == NG:
        for rep in tl.range(0, 2, loop_unroll_factor=1):
            t = globaltimer()
            t_start = t
            while t - t_start < DELAY:
                t = globaltimer()
            tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
            poll_counter(cnt_ptr + 1, NG * (rep + 1), 1 << 22)
    else:
        hq = tl.arange(0, GROUP_PAD)
        rows = g * GROUP + hq
        dcol = tl.arange(0, HD)
        for rep in tl.range(0, 2, loop_unroll_factor=1):
            if BLOB > 0:
                x = tl.zeros([GROUP_PAD, HD], dtype=tl.float32) + (dcol[None, :] + hq[:, None] * HD + rep).to(tl.float32)
                for i in tl.static_range(BLOB):
                    x = x * (1.0 + (i + 1) * 1e-6) + (i + 1) * 1e-3
                tl.store(out_ptr + rows[:, None] * HD + dcol[None, :], x, mask=(hq < GROUP)[:, None] & (pos < 0))
            bad_c, bad_s, t0 = attn_partial_device(0, g, 0, pos, wtab_ptr, kc, vc, q_ptr, out_ptr, out_ptr, out_ptr,
                                                   NQ, HD, GROUP, GROUP_PAD, MAX_SEQ, QSCALE, 1, 0, ATTN_BLOCK, False,
                                                   ATTN_STAGES, 1, ins_ptr, cnt_ptr, rep + 1, 1 << 22, True)
            tl.debug_barrier()
            tl.atomic_add(cnt_ptr + 1, 1, sem="release", scope="gpu")
            t4 = globaltimer()
            tl.store(times_ptr + g * 8 + 3 * rep, t0)
            tl.store(times_ptr + g * 8 + 3 * rep + 1, t4)
            tl.store(times_ptr + g * 8 + 3 * rep + 2, bad_c.to(tl.int64))


def _tape_header(dev):
    """The attention's two-wait tape header for ``tape_waits``: counter 0, one producer a call; no second wait."""
    from opcodes import HEADER, MAX_WAITS
    words = [0] * (1 + 2 * MAX_WAITS)
    words[1:3] = [0, 1]
    for k in range(1, MAX_WAITS):
        words[1 + 2 * k:3 + 2 * k] = [-1, 0]
    return torch.tensor(words + [0] * max(0, HEADER - len(words)), dtype=torch.int32, device=dev)


def _inputs(dev):
    """The probe's K/V caches, q, output, counters and (zero) offset table."""
    from opcodes import Layout
    torch.manual_seed(0)
    kc = torch.randn(GROUPS, MAX_SEQ, HD, device=dev).to(torch.bfloat16)
    vc = torch.randn(GROUPS, MAX_SEQ, HD, device=dev).to(torch.bfloat16)
    q = torch.randn(GROUPS * GROUP, HD, device=dev)
    out = torch.zeros(GROUPS * GROUP, HD, device=dev)
    cnt = torch.zeros(2, dtype=torch.int32, device=dev)
    wtab = torch.zeros(len(Layout.TENSORS), dtype=torch.int64, device=dev)
    return kc, vc, q, out, cnt, wtab


def _l2_flusher(dev, flush: bool):
    """A function of the call number that writes 256 MB (evicting the L2) if ``flush``, else does nothing."""
    if not flush:
        return lambda c: None
    junk = torch.empty(64 << 20, dtype=torch.float32, device=dev)
    return lambda c: junk.fill_(float(c))


def run_twice(calls: int = 30, blob: int = 0, flush: bool = False):
    """Exec (wait met -> signal) of the first and the second attention of each launch, us: lists over calls x groups.
    ``flush``: 256 MB written before each launch, so that what the first attention reads after its wait, its
    code among it (not fetched since the last launch; with ``blob``, not in its SM's instruction cache
    either), comes from the HBM, as in the decoder if the ~120 MB a layer streams evict it from the L2; the
    second reads it from the L2."""
    dev = torch.device("cuda")
    kc, vc, q, out, cnt, wtab = _inputs(dev)
    ins = _tape_header(dev)
    times = torch.zeros(GROUPS + 1, 8, dtype=torch.int64, device=dev)
    flush_l2 = _l2_flusher(dev, flush)
    first, second = [], []
    for c in range(calls + 3):
        flush_l2(c)
        cnt.zero_()
        _attn_twice[(GROUPS + 1,)](kc, vc, q, out, cnt, times, wtab, ins, 128, NQ=GROUPS * GROUP, HD=HD, GROUP=GROUP,
                                   GROUP_PAD=GROUP_PAD, MAX_SEQ=MAX_SEQ, QSCALE=QSCALE, ATTN_BLOCK=ATTN_BLOCK,
                                   ATTN_STAGES=ATTN_STAGES, DELAY=DELAY_NS, BLOB=blob, num_warps=4)
        torch.cuda.synchronize()
        t = times.cpu().tolist()
        if int(cnt[1]) != 2 * GROUPS or any(t[g][2] != -1 or t[g][5] != -1 for g in range(GROUPS)):
            raise RuntimeError(f"{int(cnt[1])} of {2 * GROUPS} signals; waits {[(t[g][2], t[g][5]) for g in range(GROUPS)]}")
        if c < 3:
            continue
        for g in range(GROUPS):
            first.append((t[g][1] - t[g][0]) / 1e3)
            second.append((t[g][4] - t[g][3]) / 1e3)
    err = (out - reference(kc, vc, q, 128)).abs().max().item()
    if err > 5e-2:
        raise RuntimeError(f"the probe's attention is {err:.3g} from the reference")
    return first, second


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _attn_opcode(kc, vc, q_ptr, out_ptr, cnt_ptr, times_ptr, wtab_ptr, ins_ptr, src_ptr, pos, NQ: tl.constexpr,
                 HD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, MAX_SEQ: tl.constexpr,
                 QSCALE: tl.constexpr, ATTN_BLOCK: tl.constexpr, ATTN_STAGES: tl.constexpr, DELAY: tl.constexpr,
                 FRESH: tl.constexpr = 0, BUSY: tl.constexpr = 0, junk_ptr=None, sink_ptr=None,
                 PAGES: tl.constexpr = 0):
    # the opcode's own device function (ATTN_PARTIAL with A_WAIT: `_attn_whole`, its waits read from a tape
    # header at ins_ptr, made by `tape_waits`), compiled alone: is the decoder's 3.5 us the code or its kernel?
    # FRESH: the releaser writes (bit 1) q and (bit 2) each group's key and value at pos (from src_ptr: q, then
    # the keys, then the values, fp32) just before it releases, as the decoder's QKV tiles write them before
    # their signal. BUSY: the programs after the releaser each first stream BUSY KB from junk_ptr (the HBM, as
    # the decoder's QKV tiles stream Wqkv until just before the attention's wait is met), then poll the
    # attention's signals, as the O tiles do. PAGES: each attention program first reads one word from each of
    # PAGES 2 MB pages of junk_ptr (a cold address-translation cache for what it reads after its wait, as the
    # decoder's SMs touch other pages between two attentions)
    g = tl.program_id(0)
    NG: tl.constexpr = NQ // GROUP
    if g > NG:
        offs = tl.arange(0, 8192)
        x = tl.zeros([8192], dtype=tl.int32)
        base = junk_ptr + (g - NG - 1).to(tl.int64) * (BUSY * 256)
        for i in tl.range(0, BUSY * 256, 16384, loop_unroll_factor=1):
            a = tl.load(base + i + offs, cache_modifier=".cg")
            b = tl.load(base + i + 8192 + offs, cache_modifier=".cg")
            x = x ^ a ^ b
        tl.store(sink_ptr + g, tl.reduce(x, 0, _xor))
        poll_counter(cnt_ptr + 1, NG, 1 << 22)
    elif g == NG:
        t = globaltimer()
        t_start = t
        while t - t_start < DELAY:
            t = globaltimer()
        d = tl.arange(0, HD)[None, :]
        if FRESH & 1:
            r = tl.arange(0, NQ)[:, None]
            tl.store(q_ptr + r * HD + d, tl.load(src_ptr + r * HD + d))
        if FRESH & 2:
            gg = tl.arange(0, NG)[:, None]
            kn = tl.load(src_ptr + NQ * HD + gg * HD + d)
            vn = tl.load(src_ptr + (NQ + NG) * HD + gg * HD + d)
            tl.store(kc + gg * (MAX_SEQ * HD) + pos * HD + d, kn.to(tl.bfloat16))
            tl.store(vc + gg * (MAX_SEQ * HD) + pos * HD + d, vn.to(tl.bfloat16))
        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
        poll_counter(cnt_ptr + 1, NG, 1 << 22)
    else:
        if PAGES > 0:
            w = tl.load(junk_ptr + tl.arange(0, PAGES).to(tl.int64) * (1 << 19) + g * 64, cache_modifier=".cg")
            tl.store(sink_ptr + g, tl.reduce(w, 0, _xor))
            tl.debug_barrier()
        bad_c, bad_s, t0 = attn_partial_device(0, g, 0, pos, wtab_ptr, kc, vc, q_ptr, out_ptr, out_ptr, out_ptr,
                                               NQ, HD, GROUP, GROUP_PAD, MAX_SEQ, QSCALE, 1, 0, ATTN_BLOCK, False,
                                               ATTN_STAGES, 1, ins_ptr, cnt_ptr, 1, 1 << 22, True)
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + 1, 1, sem="release", scope="gpu")
        t4 = globaltimer()
        tl.store(times_ptr + g * 8, t0)
        tl.store(times_ptr + g * 8 + 1, t4)
        tl.store(times_ptr + g * 8 + 2, bad_c.to(tl.int64))


def run_opcode(calls: int = 30, delay_ns: int = DELAY_NS, flush: bool = False, maxnreg: int | None = None,
               fresh: int = 0, busy_kb: int = 0, pages: int = 0):
    """Exec (wait met -> signal) of the opcode's device function compiled alone, us, over calls x groups.
    ``delay_ns``: how long the releaser waits (the attention program idles that long before its wait is met);
    ``flush``: 256 MB written before each launch, so that the K/V prefix comes from the HBM, not the L2.
    ``maxnreg``: the registers a thread may use (ptxas's limit), as the 255-register megakernel leaves its
    branches fewer than a kernel of their own has. ``fresh``: q (bit 1) and the key and value at pos (bit 2)
    written by the releaser just before its release (the same values), as in the decoder, where other SMs
    wrote them. ``busy_kb``: 123 more programs each stream that many KB from the HBM (a different part of a 1 GB
    buffer each call), then poll the attention's signals. ``pages``: each attention program first reads one
    word from each of that many 2 MB pages of that buffer."""
    dev = torch.device("cuda")
    kc, vc, q, out, cnt, wtab = _inputs(dev)
    src = torch.cat([q.flatten(), kc[:, 128].float().flatten(), vc[:, 128].float().flatten()])
    ins = _tape_header(dev)
    regs = {"maxnreg": maxnreg} if maxnreg else {}
    times = torch.zeros(GROUPS + 1, 8, dtype=torch.int64, device=dev)
    execs = []
    flush_l2 = _l2_flusher(dev, flush)
    streamers = 123 if busy_kb else 0
    big = torch.ones(256 << 20, dtype=torch.int32, device=dev) if busy_kb or pages else None
    sink = torch.zeros(GROUPS + 1 + streamers, dtype=torch.int32, device=dev)
    span = streamers * busy_kb * 256
    for c in range(calls + 3):
        flush_l2(c)
        cnt.zero_()
        if fresh & 1:       # what the releaser writes again: stale values until it does
            q.zero_()
        if fresh & 2:
            kc[:, 128].zero_()
            vc[:, 128].zero_()
        part = big if pages else big[(c * span) % (big.numel() - span):][:span] if busy_kb else sink
        _attn_opcode[(GROUPS + 1 + streamers,)](kc, vc, q, out, cnt, times, wtab, ins, src, 128, NQ=GROUPS * GROUP,
                                                HD=HD, GROUP=GROUP, GROUP_PAD=GROUP_PAD, MAX_SEQ=MAX_SEQ,
                                                QSCALE=QSCALE, ATTN_BLOCK=ATTN_BLOCK, ATTN_STAGES=ATTN_STAGES,
                                                DELAY=delay_ns, FRESH=fresh, BUSY=busy_kb, junk_ptr=part,
                                                sink_ptr=sink, PAGES=pages, num_warps=4, **regs)
        torch.cuda.synchronize()
        t = times.cpu().tolist()
        if any(t[g][2] != -1 for g in range(GROUPS)):
            raise RuntimeError(f"a wait failed: {[t[g][2] for g in range(GROUPS)]}")
        if c >= 3:
            execs += [(t[g][1] - t[g][0]) / 1e3 for g in range(GROUPS)]
    err = (out - reference(kc, vc, q, 128)).abs().max().item()
    if err > 5e-2:
        raise RuntimeError(f"the opcode's attention is {err:.3g} from the reference")
    return execs


def reference(kc, vc, q, pos):
    """The attention of every query head over keys [0, pos], fp32 (what the probe's output must be)."""
    out = torch.empty(GROUPS * GROUP, HD, device=q.device)
    for g in range(GROUPS):
        k = kc[g, :pos + 1].float()
        v = vc[g, :pos + 1].float()
        qq = q[g * GROUP:(g + 1) * GROUP]
        s = (qq @ k.T) / math.sqrt(HD)
        out[g * GROUP:(g + 1) * GROUP] = torch.softmax(s, dim=1) @ v
    return out


def run(calls: int = 50, pos: int = 128, mode: int = 0, pollers: int = 0, sleep_ns: int = 0):
    dev = torch.device("cuda")
    kc, vc, q, out, cnt, _ = _inputs(dev)
    times = torch.zeros(GROUPS + 2 + (pollers + 7) // 8, 8, dtype=torch.int64, device=dev)
    rows = []
    for c in range(calls + 3):
        cnt.zero_()
        _attn_timed[(GROUPS + 1 + pollers,)](kc, vc, q, out, cnt, times, pos, NQ=GROUPS * GROUP, HD=HD, GROUP=GROUP,
                                   GROUP_PAD=GROUP_PAD, MAX_SEQ=MAX_SEQ, QSCALE=QSCALE, ATTN_BLOCK=ATTN_BLOCK,
                                   ATTN_STAGES=ATTN_STAGES, DELAY=DELAY_NS, MODE=mode, SLEEP=sleep_ns,
                                   num_warps=4)
        torch.cuda.synchronize()
        if c < 3:
            continue
        t = times.cpu().tolist()
        rel, seen = t[GROUPS][0], t[GROUPS][1]
        if t[GROUPS][2] != GROUPS:
            raise RuntimeError(f"the releaser saw {t[GROUPS][2]} of {GROUPS} signals")
        for g in range(GROUPS):
            t0, t1, t2, t3, t4 = t[g][:5]
            last = max(x[4] for x in t[:GROUPS])
            flat = [v for r in t[GROUPS + 1:] for v in r][:pollers]
            rows.append({"poll": t0 - rel, "qkv": t1 - t0, "block": t2 - t1, "newkey": t3 - t2,
                         "store_signal": t4 - t3, "exec": t4 - t0, "seen": seen - last,
                         "pollers_seen": (statistics.median(flat) - last) if flat else 0})
    err = (out - reference(kc, vc, q, pos)).abs().max().item()
    if err > 5e-2:
        raise RuntimeError(f"the probe's attention is {err:.3g} from the reference")
    return rows, err


def _aligned(sig: dict) -> dict:
    """The pointer arguments of ``sig`` 16-byte aligned, as Triton's JIT specializes them when a launch passes
    aligned tensors (without it the key loop's loads cannot be async copies, and the compile would not be the
    kernel that runs)."""
    return {(k,): [["tt.divisibility", 16]] for k, (n, t) in enumerate(sig.items()) if t.startswith("*")}


def compile_sm90(mode: int = 1, sleep_ns: int = 0) -> dict:
    """The probe kernel compiled for sm_90 (no GPU): its shared memory, and in its PTX the clock reads, the
    async copies (the prefix's pipelined prologue, as in the decoder's loop), acquire polls and nanosleeps."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"kc": "*bf16", "vc": "*bf16", "q_ptr": "*fp32", "out_ptr": "*fp32", "cnt_ptr": "*i32", "times_ptr": "*i64",
           "pos": "i32"}
    consts = dict(NQ=GROUPS * GROUP, HD=HD, GROUP=GROUP, GROUP_PAD=GROUP_PAD, MAX_SEQ=MAX_SEQ, QSCALE=QSCALE,
                  ATTN_BLOCK=ATTN_BLOCK, ATTN_STAGES=ATTN_STAGES, DELAY=DELAY_NS, MODE=mode, SLEEP=sleep_ns)
    sig.update({k: "constexpr" for k in consts})
    ck = triton.compile(ASTSource(fn=_attn_timed, signature=sig, constexprs=consts, attrs=_aligned(sig)),
                        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = ck.asm["ptx"]
    return {"shared": ck.metadata.shared, "clock_reads": ptx.count("%globaltimer"),
            "cp.async": ptx.count("cp.async.cg.shared.global") + ptx.count("cp.async.ca.shared.global"),
            "acquire": ptx.count("ld.global.gpu.acquire") + ptx.count("ld.global.acquire.gpu"),
            "nanosleep": ptx.count("nanosleep")}


def compile_others(blob: int = 16) -> dict:
    """`--cold`'s kernel (with a ``blob`` of other code) and `--opcode`'s, compiled for sm_90 (no GPU): the FFMA
    of the blob and the acquire polls (the releaser's and the attention's own, `tape_waits` in `--opcode`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    base = {"kc": "*bf16", "vc": "*bf16", "q_ptr": "*fp32", "out_ptr": "*fp32", "cnt_ptr": "*i32", "times_ptr": "*i64"}
    consts = dict(NQ=GROUPS * GROUP, HD=HD, GROUP=GROUP, GROUP_PAD=GROUP_PAD, MAX_SEQ=MAX_SEQ, QSCALE=QSCALE,
                  ATTN_BLOCK=ATTN_BLOCK, ATTN_STAGES=ATTN_STAGES, DELAY=DELAY_NS)
    out = {}
    tables = {"wtab_ptr": "*i64", "ins_ptr": "*i32"}
    for name, fn, extra, more in (("twice", _attn_twice, tables, {"BLOB": blob}),
                                  ("twice/noblob", _attn_twice, tables, {"BLOB": 0}),
                                  ("opcode", _attn_opcode, dict(tables, src_ptr="*fp32"), {"FRESH": 0, "BUSY": 0}),
                                  ("opcode/fresh", _attn_opcode, dict(tables, src_ptr="*fp32"), {"FRESH": 3, "BUSY": 0}),
                                  ("opcode/busy", _attn_opcode, dict(tables, src_ptr="*fp32"), {"FRESH": 0, "BUSY": 192}),
                                  ("opcode/pages", _attn_opcode, dict(tables, src_ptr="*fp32"), {"FRESH": 0, "BUSY": 0})):
        sig = dict(base, **extra, pos="i32")
        c = dict(consts, **more)
        sig.update({k: "constexpr" for k in c})
        if fn is _attn_opcode:
            sig.update(junk_ptr="*i32", sink_ptr="*i32", PAGES="constexpr")
            c["PAGES"] = 256 if name == "opcode/pages" else 0
        ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c, attrs=_aligned(sig)),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        ptx = ck.asm["ptx"]
        out[name] = {"shared": ck.metadata.shared, "fma": ptx.count("fma.rn.f32"),
                     "cp.async": ptx.count("cp.async.cg.shared.global") + ptx.count("cp.async.ca.shared.global"),
                     "acquire": ptx.count("ld.global.gpu.acquire") + ptx.count("ld.global.acquire.gpu"),
                     "stores": ptx.count("st.global"), "loads": ptx.count("ld.global")}
    return out


def main(argv):
    if argv[:1] == ["--opcode"]:
        print(torch.cuda.get_device_name(), "the opcode's own device function alone, exec (wait met -> signal) us")
        for delay_ns, flush, regs in ((5000, False, None), (45000, False, None), (5000, True, None),
                                      (45000, True, None), (5000, False, 128), (5000, False, 96), (5000, False, 64),
                                      (5000, False, None)):
            ex = run_opcode(30, delay_ns, flush, regs)
            print(f"opcode, idle {delay_ns / 1e3:.0f} us before its wait met, prefix from "
                  f"{'the HBM' if flush else 'the L2'}, registers {regs or 'unlimited'}: "
                  f"{statistics.median(ex):.2f} / {max(ex):.2f}")
        return
    if argv[:1] == ["--fresh"]:
        print(torch.cuda.get_device_name(), "the opcode alone; q and the new key written by another SM just before "
              "the release, or long before; exec (wait met -> signal) us, median / max")
        for fresh in (0, 3, 1, 2, 0, 3, 1, 2):
            ex = run_opcode(30, 5000, False, None, fresh)
            what = {0: "nothing", 1: "q", 2: "the new key and value", 3: "q, the new key and value"}[fresh]
            print(f"written just before the release: {what}: {statistics.median(ex):.2f} / {max(ex):.2f}")
        for busy_kb, fresh in ((0, 0), (192, 0), (1024, 0), (192, 3), (0, 0), (192, 0), (1024, 0), (192, 3)):
            ex = run_opcode(30, 5000, False, None, fresh, busy_kb)
            print(f"123 programs streaming {busy_kb} KB each from the launch, then polling; fresh {fresh}: "
                  f"{statistics.median(ex):.2f} / {max(ex):.2f}")
        for pages in (0, 128, 512, 0, 128, 512):
            ex = run_opcode(30, 5000, False, None, 3, 0, pages)
            print(f"fresh 3, a word of each of {pages} 2 MB pages read before the wait: "
                  f"{statistics.median(ex):.2f} / {max(ex):.2f}")
        return
    if argv[:1] == ["--cold"]:
        flush = argv[1:2] == ["--flush"]
        print(torch.cuda.get_device_name(), "the attention twice a launch, exec (wait met -> signal) us, median / max"
              + ("; the L2 flushed before each launch" if flush else ""))
        for blob in (0, 1200, 0, 1200):
            first, second = run_twice(30, blob, flush)
            print(f"blob {blob} (~{blob * 128 // 1024} KB of other code before each): first {statistics.median(first):.2f} / "
                  f"{max(first):.2f}; second {statistics.median(second):.2f} / {max(second):.2f}")
        return
    if argv[:1] == ["--compile"]:
        import json
        got = {f"mode{m}" + (f"/sleep{z}" if z else ""): compile_sm90(m, z) for m, z in ((0, 0), (1, 0), (2, 0), (0, 100))}
        got.update(compile_others())
        print(json.dumps(got))
        return
    calls = int(argv[0]) if argv else 50
    print(torch.cuda.get_device_name(), f"pos 128, 8 groups, {calls} calls; us, median / max over calls and groups")
    for mode, pollers, sleep_ns in ((0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 123, 0), (1, 123, 0), (0, 123, 100),
                                    (0, 123, 400)):
        rows, err = run(calls, 128, mode, pollers, sleep_ns)
        keys = ("poll", "exec", "seen", "pollers_seen") if mode == 0 else \
            ("poll", "qkv", "block", "newkey", "store_signal", "exec", "seen", "pollers_seen")
        cells = [f"{k} {statistics.median(r[k] for r in rows) / 1e3:.2f} / {max(r[k] for r in rows) / 1e3:.2f}"
                 for k in keys]
        print(f"MODE {mode}, {pollers} pollers {sleep_ns} ns apart (max err {err:.1e}): " + "; ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
