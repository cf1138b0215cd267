"""Where a rows step's time goes (issue 50): one profiled launch of a rows kernel, per opcode the summed
execution and wait time across SMs, the step's span, and the stage spans per layer.

    python -m bench.probes.rows_profile --preset llama3.2-1b --R 16 --B 16 --pos 1024 [--tiling "k=v,...;k=v"]
    python -m bench.probes.rows_profile --R 128 --prefill     # a prefill chunk: slot 0's positions pos .. pos + R - 1
    python -m bench.probes.rows_profile --R 1024 --prefill --last-logits --lm-rows ";256"   # a prompt's last chunk


``--tiling``: variants separated by ``;`` (an empty one: the default tiling), each timed (the median of 10
back-to-back launches after 3, each between two events; before session 47 their mean); the first profiled.
``--lm-rows``: the LM head tiles' vocabulary rows, one a variant likewise (session 45: 128 in the decode buckets).
Each variant's output (the last layer's normed rows, ``hn_r``) is compared with the first variant's: a variant
that only reorders the schedule must give the same bits, one that changes a tile's sums the same to ~1e-2
(session 45: v173's per-block counters gave other logits on the GPU, seen only by eye in a timeline's argmax).
That comparison is no accuracy measure for a variant that sums in another order: over 16 / 32 layers of random
weights any such variant moved the last layer's normed rows by ~1e-1 of their largest value (run 312).
``--accuracy``: each variant's logits of a few rows (a prefill chunk's first, middle and last; the first 4 decode
rows) from one more launch, against the all-fp32 reference: the multi-layer criterion (error <= 1.1x the bf16
reference's, the greedy token agreeing where the fp32 top-2 margin is decisive), the references computed once.
"""
from __future__ import annotations

import argparse
import collections
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--R", type=int, default=16)
    p.add_argument("--B", type=int, default=16)
    p.add_argument("--pos", type=int, default=1024)
    p.add_argument("--tiling", default="")
    p.add_argument("--lm-rows", default="",
                   help="vocabulary rows per LM head tile, one a variant, separated by ';' as --tiling's (an empty "
                        "one: the layout's; a single value: every variant)")
    p.add_argument("--prefill", action="store_true",
                   help="one slot's R consecutive positions from --pos, no LM head (a prefill chunk), not B slots")
    p.add_argument("--last-logits", action="store_true",
                   help="with --prefill: the LM head computes the last row's logits group, as a prompt's last chunk "
                        "(bench/notes/s52.md: +488 us on the 1B's 1024-row chunk)")
    p.add_argument("--accuracy", action="store_true",
                   help="each variant's logits of a few rows against the fp32 reference (the multi-layer criterion)")
    p.add_argument("--tokens", choices=("distinct", "same"), default="distinct",
                   help="the rows' tokens: distinct ((17 r + 5) mod vocab, as the rows bench's decode) or all 7 "
                        "(every probe before session 44: identical columns, less toggling in the MMAs)")
    a = p.parse_args(argv)
    if a.last_logits and not a.prefill:
        p.error("--last-logits: only with --prefill (a decode step computes every row's logits)")
    if a.prefill:
        a.B = 1
    variants = a.tiling.split(";")
    lms = a.lm_rows.split(";")
    if len(lms) == 1:
        lms = lms * len(variants)
    if len(lms) != len(variants) or not all(x == "" or x.isdigit() and int(x) >= 16 for x in lms):
        p.error(f"--lm-rows: one number >= 16 (or nothing) for each of the {len(variants)} --tiling variants, "
                f"got {a.lm_rows!r}")
    from bench.decoder_bench import make_decoder_weights
    from opcodes.config import ModelConfig
    from opcodes.reference import make_kv_cache
    from opcodes.rows import rows_tiling
    cfg = ModelConfig.from_name(a.preset)
    ms = a.pos + max(128, a.R)
    w = make_decoder_weights(cfg, 0, "cuda")
    kv = make_kv_cache(cfg, ms, a.pos, seed=1, device="cuda", batch=a.B)
    dev = torch.device("cuda", torch.cuda.current_device())
    refs = step_references(a, cfg, w, kv) if a.accuracy else None
    first = None
    for vi, (var, lm) in enumerate(zip(variants, lms)):
        til = rows_tiling(cfg, a.R, ms, **({k: int(v) for k, v in (kv_.split("=") for kv_ in var.split(","))}
                                            if var else {}))
        name = ",".join(x for x in (var, f"lm_rows={lm}" if lm else "") if x) or "default"
        try:
            out, lg = run_variant(a, cfg, w, kv, ms, til, int(lm or 0), dev, name, profile=vi == 0,
                                  check_rows=refs[0] if refs else None)
        except Exception as e:   # a variant that does not build is reported, the others still run
            print(f"variant {name}: {type(e).__name__}: {e}", flush=True)
            continue
        if refs:
            print(accuracy_line(name, refs[0], lg, refs[1], refs[2]), flush=True)
        if first is None:
            first = (name, out)
        else:
            print(f"{name}: output against {first[0]}'s: {compare(first[1], out)}", flush=True)
    return 0


def compare(ref: torch.Tensor, got: torch.Tensor) -> str:
    """How ``got`` differs from ``ref`` (two runs' outputs of one step): "bitwise equal", else the largest
    difference relative to ``ref``'s largest magnitude, and where a value is not finite in one of them."""
    if ref.shape != got.shape:
        return f"shapes differ: {tuple(ref.shape)} against {tuple(got.shape)}"
    if torch.equal(ref, got):
        return "bitwise equal"
    bad = int((torch.isfinite(ref) != torch.isfinite(got)).sum())
    fin = torch.isfinite(ref) & torch.isfinite(got)
    rel = float((ref[fin] - got[fin]).abs().max() / ref[fin].abs().max().clamp_min(1e-30)) if bool(fin.any()) else 0.0
    return f"max difference {rel:.3e} of the largest value" + (f"; {bad} values finite in one only" if bad else "")


def step_rows(a, cfg) -> tuple[list[int], list[int], list[int]]:
    """The step's rows: (slots, positions, tokens)."""
    n = a.R if a.prefill else a.B
    toks = [7] * n if a.tokens == "same" else [(17 * r + 5) % cfg.vocab for r in range(n)]
    if a.prefill:
        return [0] * n, list(range(a.pos, a.pos + n)), toks
    return list(range(n)), [a.pos] * n, toks


def step_references(a, cfg, w, kv) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The rows ``--accuracy`` checks and their bf16 and fp32 reference logits (``opcodes.decoder``), from copies
    of the cache as the step finds it (the step writes its own rows' K/V first, as the references do)."""
    from opcodes.decoder import decoder_ref_rows, decoder_ref_rows_fp32
    slots, pos, toks = step_rows(a, cfg)
    n = len(toks)
    sel = sorted({0, n // 2, n - 1}) if a.prefill else list(range(min(4, n)))
    ref = decoder_ref_rows(w, [tuple(t.clone() for t in p) for p in kv], cfg, toks, slots, pos)[sel]
    ref32 = decoder_ref_rows_fp32(w, [tuple(t.float() for t in p) for p in kv], cfg, toks, slots, pos)[sel]
    return sel, ref, ref32


def accuracy_line(name: str, sel: list[int], lg: torch.Tensor, ref: torch.Tensor, ref32: torch.Tensor) -> str:
    """A variant's logits of rows ``sel`` (len(sel), vocab) against the references: the multi-layer criterion
    per row (``opcodes.decoder.step_accuracy``), one line."""
    from opcodes.decoder import step_accuracy
    accs = [step_accuracy(lg[i:i + 1], ref[i:i + 1], ref32[i:i + 1]) for i in range(len(sel))]
    ok = [x["err"] <= 1.1 * x["ref_err"] and (x["agree"] or not x["decisive"]) for x in accs]
    rows = ", ".join(f"row {r} {x['err'] / x['ref_err']:.2f}x" + ("" if x["agree"] else " (greedy differs"
                                                                  + (")" if x["decisive"] else ", not decisive)"))
                     for r, x in zip(sel, accs))
    return (f"{name}: accuracy against the fp32 reference (err / the bf16 reference's): {rows}: "
            + ("meets the criterion" if all(ok) else f"FAILS the criterion in {ok.count(False)} row(s)"))


def run_variant(a, cfg, w, kv, ms, til, lm_rows, dev, name, profile, check_rows=None):
    """Time (and with ``profile`` profile) one variant; returns its output (``hn_r``'s last layer, and a decode
    step's logits) and, with ``check_rows``, those rows' logits from one more launch that computes every row's."""
    from bench.rows_bench import back_to_back_us
    from interp import runtime
    from interp.rows import read_logits
    from opcodes.rows import LOGIT_GROUP, rows_state
    from schedule.rows_program import rows_lowering
    slots, pos, toks = step_rows(a, cfg)
    lg = None
    for prof in ((False, True) if profile else (False,)):
        h = runtime.build_validated(w, kv, cfg, dev, ms, tiling=til, lowering=rows_lowering(a.R, a.B, lm_rows),
                                    profile=prof)
        st = rows_state(a.R, slots, pos, toks, logits=not a.prefill or a.last_logits,
                        group=(a.R - 1) // LOGIT_GROUP if a.prefill and a.last_logits else None)
        h.state["rows"].copy_(st)
        x = torch.zeros(1, cfg.d, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            runtime.launch(h, x, 0, x)
        torch.cuda.synchronize()
        us = sorted(back_to_back_us(lambda: runtime.launch(h, x, 0, x), 10))
        print(f"{name}: {'profiled' if prof else 'plain'}: {(us[4] + us[5]) / 2:.1f} us a step (median of 10; "
              f"{us[0]:.1f} .. {us[-1]:.1f}) ({len(h.tape)} instructions)", flush=True)
        if not prof:
            out = h.scratch["hn_r"][-1].float().flatten()     # the last layer's normed rows: [d, R], blocked
            if not a.prefill:                                 # and the step's logits
                out = torch.cat([out, h.scratch["logits_r"].float().flatten()])
            if check_rows is not None:                        # every row's logits, once, untimed
                h.state["rows"].copy_(rows_state(a.R, slots, pos, toks, logits=True))
                runtime.launch(h, x, 0, x)
                lay = h.tape.lay
                lg = read_logits(h.scratch["logits_r"].view(lay.n_blocks, cfg.vocab, lay.n_tile), check_rows).float()
        if prof:
            recs = runtime.profile_records(h).tolist()
            from schedule.tape import decode
            ins = {d.slot: d.ins for d in decode(h.tape)}
            t0 = min(r[0] for r in recs if r[0] > 0)
            t1 = max(r[2] for r in recs)
            by = collections.defaultdict(lambda: [0, 0.0, 0.0])
            stage = collections.defaultdict(lambda: [1e30, 0])
            for slot, (tw, te, tend, sm) in enumerate(recs):
                name = ins[slot].NAME
                by[name][0] += 1
                by[name][1] += (tend - te) / 1e3
                by[name][2] += (te - tw) / 1e3
                lay = getattr(ins[slot], "layer", -1)
                if lay in (0, 1):
                    s = stage[(lay, name)]
                    s[0] = min(s[0], te - t0)
                    s[1] = max(s[1], tend - t0)
            print(f"span {(t1 - t0) / 1e3:.1f} us; per opcode: count, exec us (sum over SMs, mean), wait us (sum)")
            for n, (c, e, wt) in sorted(by.items(), key=lambda kv_: -kv_[1][1]):
                print(f"  {n:12s} {c:6d}  exec {e:10.1f} ({e / c:6.2f})  wait {wt:10.1f}")
            for (l, n), (s0, s1) in sorted(stage.items(), key=lambda kv_: kv_[1][0]):
                print(f"  layer {l} {n:12s} {s0 / 1e3:8.1f} .. {s1 / 1e3:8.1f} us")
        runtime.teardown(h)
    return out, lg


if __name__ == "__main__":
    sys.exit(main())
