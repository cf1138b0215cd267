"""Issue 50 on a GPU: many rows per step. Batched decode tokens/s, time to first token of a prefill
beside transformers' forward over the prompt, per-row accuracy, and batch invariance; one preset a run.

    python -m bench.rows_bench --preset llama3.2-1b [--B 1,4,8,16,32] [--pos 1024] [--prompts 128,1024,4096]
                               [--chunks 0,512] [--reps 10] [--no-hf] [--out DIR]

Random weights of the preset's shape (``bench.decoder_bench.make_decoder_weights``, tied head) and a
random cache prefilled to ``--pos`` in every slot. Timings are CUDA-event medians:
- decode: a CUDA graph of 16 launches replayed, per step; B = 1 both ways: today's one-row kernel at
  ``pos`` (what ``generate`` runs) and the rows kernel with one row; B > 1 the rows kernel, row b in
  slot b at ``pos``; tokens/s = B / step.
- TTFT: ``prefill(h, prompt)`` (every chunk's launch and the host work between them; the buckets are
  compiled before), beside ``transformers`` ``LlamaForCausalLM(sdpa, bf16).forward(ids, logits_to_keep=1)``
  (``bench.ttft_baseline.forward_ms``) and the one-row decode step at the prompt's length; each prompt once
  per ``--chunks`` entry (``prefill``'s ``chunk``; 0: its default chunks), the baseline once.
Accuracy: each row of a ragged 8-row step (slots 0..7, positions pos .. pos + 21) against
``decoder_ref_rows_fp32`` (``opcodes.decoder.step_accuracy``: error <= 1.1x the bf16 reference's, greedy
agreement where decisive), and the prefill's last logits likewise (prompts <= 1024).
Invariance: a row alone (R = 1), beside 15 others (R 16) and beside 31 others (R 32, the next bucket):
its logits bitwise, and 8 greedy steps of a request alone and in a 16-row batch.
Writes rows-<preset>.json under --out."""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch


def _events_ms(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out


def back_to_back_us(launch, reps: int) -> list[float]:
    """Microseconds of each of ``reps`` calls of ``launch`` issued back to back, an event between each two (the
    device never idles between them: a launch's time, not its host's), in issue order."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for e in ev[1:]:
        launch()
        e.record()
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(reps)]


def graph_step_ms(launch, reps: int, k: int = 16) -> float:
    """Median ms per launch of ``launch`` replayed as a CUDA graph of ``k`` launches."""
    launch()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(k):
            launch()
    g.replay()
    torch.cuda.synchronize()
    return statistics.median(_events_ms(g.replay, reps)) / k


def _ttft(h, toks, chunk, reps, dstep) -> dict:
    """One prompt's prefill into slot 1 in chunks of ``chunk`` (None: the default's): its first call (which
    compiles the buckets it needs), then ``reps`` timed ones, beside ``dstep``, the one-row decode step (ms) at
    its length."""
    from interp import prefill
    n = len(toks)
    t = time.time()
    prefill(h, toks, 0, slot=1, chunk=chunk)
    torch.cuda.synchronize()
    first_s = time.time() - t
    ms = _events_ms(lambda: prefill(h, toks, 0, slot=1, chunk=chunk), reps)
    return dict(prompt=n, chunk=chunk or 0, prefill_ms=statistics.median(ms), prefill_ms_min=min(ms),
                first_call_s=first_s, decode_step_ms=dstep, x_decode_steps=statistics.median(ms) / dstep)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rows_bench", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--B", default="1,4,8,16,32")
    p.add_argument("--pos", type=int, default=1024)
    p.add_argument("--prompts", default="128,1024,4096")
    p.add_argument("--chunks", default="0", help="prefill chunk sizes to time each prompt with (0: the default's)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--skip", default="", help="comma list of parts to skip: decode, accuracy, invariance, ttft")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench.rows_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.decoder_bench import make_decoder_weights
    from interp import build_decoder, decode_step, prefill, teardown
    from interp import decoder as dec
    from interp import runtime
    from interp.rows import decode_rows, rows_handle
    from opcodes.config import ModelConfig
    from opcodes.decoder import decoder_ref_rows, decoder_ref_rows_fp32, step_accuracy
    from opcodes.reference import make_kv_cache
    from opcodes.rows import rows_state

    skip = set(filter(None, a.skip.split(",")))
    cfg = ModelConfig.from_name(a.preset)
    Bs = [int(x) for x in a.B.split(",")]
    prompts = [int(x) for x in a.prompts.split(",")] if a.prompts else []
    chunks = [int(x) for x in a.chunks.split(",")]
    batch = max(Bs + [8, 32 if "invariance" not in skip else 8])
    max_seq = max([a.pos + 64] + [n + 8 for n in prompts])
    max_seq = -(-max_seq // 128) * 128
    card = torch.cuda.get_device_name()
    rep = dict(card=card, preset=a.preset, pos=a.pos, batch=batch, max_seq=max_seq, decode=[], ttft=[], accuracy=[],
               invariance={})
    t0 = time.time()
    w = make_decoder_weights(cfg, seed=0, device="cuda")
    kv = make_kv_cache(cfg, max_seq, a.pos, seed=1, device="cuda", batch=batch)
    h = build_decoder(w, kv, cfg, max_seq, batch=batch)
    print(f"{card}: {a.preset}, batch {batch}, max_seq {max_seq}: built in {time.time() - t0:.1f} s", flush=True)

    def rows_launcher(R: int, pos: int, tokens=None):
        hr = rows_handle(h, R)
        toks = tokens or [(17 * r + 5) % cfg.vocab for r in range(R)]
        hr.state["rows"].copy_(rows_state(hr.lay.rows, list(range(R)), [pos] * R, toks))
        return lambda: runtime.launch(hr, h.x0, 0, h.hidden)

    if "decode" not in skip:
        from bench.driver import stream_copy_bw
        bw = stream_copy_bw()
        rep["stream_copy_Bps"] = bw

        def floor_us(B: int) -> float:
            """HBM floor of a B-row decode step at a.pos: weights once, each row's KV once."""
            b = cfg.bytes_per_step(a.pos) + (B - 1) * cfg.layers * cfg.kv_bytes(a.pos + 1)
            return b / bw * 1e6

        print(f"stream copy {bw / 1e12:.3f} TB/s; floor B=1 {floor_us(1):.1f} us", flush=True)
        one = dec._pick(h, a.pos)
        t1 = graph_step_ms(lambda: runtime.launch(one, h.x0, a.pos, h.hidden), a.reps)
        rep["decode"].append(dict(B=1, kernel="one-row", step_us=t1 * 1e3, tokens_per_s=1e3 / t1,
                                  floor_us=floor_us(1), x_floor=t1 * 1e3 / floor_us(1)))
        print(f"decode B=1 one-row kernel: {t1 * 1e3:.1f} us/step = {t1 * 1e3 / floor_us(1):.2f}x floor", flush=True)
        for B in Bs:
            t = time.time()
            f = rows_launcher(B, a.pos)
            build_s = time.time() - t
            ms = graph_step_ms(f, a.reps)
            rep["decode"].append(dict(B=B, kernel=f"rows R{rows_handle(h, B).lay.rows}", step_us=ms * 1e3,
                                      tokens_per_s=B * 1e3 / ms, x_one_row=(B * 1e3 / ms) / (1e3 / t1),
                                      floor_us=floor_us(B), x_floor=ms * 1e3 / floor_us(B)))
            print(f"decode B={B} rows kernel (bucket {rows_handle(h, B).lay.rows}; built {build_s:.1f} s): "
                  f"{ms * 1e3:.1f} us/step = {ms * 1e3 / floor_us(B):.2f}x floor, {B * 1e3 / ms:.0f} tokens/s = "
                  f"{t1 * B / ms:.2f}x one-row B=1",
                  flush=True)

    if "accuracy" not in skip:
        R = 8
        slots = list(range(R))
        pos = [a.pos + 3 * r for r in range(R)]
        toks = [(131 * r + 7) % cfg.vocab for r in range(R)]
        kv_ref = [tuple(t[:R].clone() for t in pair) for pair in kv]
        kv32 = [tuple(t[:R].float() for t in pair) for pair in kv]
        lg = decode_step(h, torch.tensor(toks), torch.tensor(pos), slots=slots)
        ref = decoder_ref_rows(w, kv_ref, cfg, toks, slots, pos)
        ref32 = decoder_ref_rows_fp32(w, kv32, cfg, toks, slots, pos)
        for r in range(R):
            acc = step_accuracy(lg[r:r + 1], ref[r:r + 1], ref32[r:r + 1])
            acc.update(row=r, slot=slots[r], pos=pos[r], ok=acc["err"] <= 1.1 * acc["ref_err"]
                       and (acc["agree"] or not acc["decisive"]))
            rep["accuracy"].append(acc)
            print(f"row {r} (slot {slots[r]}, pos {pos[r]}): err {acc['err']:.3e} vs bf16 ref {acc['ref_err']:.3e} "
                  f"({acc['err'] / acc['ref_err']:.2f}x), decisive {acc['decisive']}, agree {acc['agree']}", flush=True)
        del kv_ref, kv32

    if "invariance" not in skip:
        p0, t0_ = a.pos + 40, 1234 % cfg.vocab
        res = {}
        for R in (1, 16, 32):
            toks = [t0_] + [(29 * r + 3) % cfg.vocab for r in range(1, R)]
            lg = decode_step(h, toks, [p0] * R, slots=list(range(R)))
            res[R] = lg[0].clone()
        # row 0 alone in the 32-row bucket: a bucket's own numerics apart from the other rows (runs 317-318)
        alone32 = decode_rows(h, [t0_], [p0], [0], min_rows=32)[0].clone()
        rep["invariance"]["row0_R1_eq_R16"] = bool(torch.equal(res[1], res[16]))
        rep["invariance"]["row0_R1_eq_R32"] = bool(torch.equal(res[1], res[32]))
        rep["invariance"]["max_abs_R1_R32"] = float((res[1] - res[32]).abs().max())
        rep["invariance"]["row0_R1_eq_R1_in_bucket32"] = bool(torch.equal(res[1], alone32))
        # 8 greedy steps of a request alone and in a 16-row batch (the others' tokens their own greedy ones)
        # (random weights with a tied head mostly repeat their input token: the logits, bitwise, are the check)
        alone, p, lg_alone = [t0_], a.pos + 41, []
        for i in range(8):
            lg = decode_step(h, [alone[-1]], [p + i], slots=[0])
            lg_alone.append(lg[0].clone())
            alone.append(int(lg.argmax(-1)[0]))
        cur = [t0_] + [(7 * r + 1) % cfg.vocab for r in range(1, 16)]
        inb, same = [t0_], []
        for i in range(8):
            lg = decode_step(h, cur, [p + i] * 16, slots=list(range(16)))
            same.append(bool(torch.equal(lg[0], lg_alone[i])))
            cur = lg.argmax(-1).tolist()
            inb.append(cur[0])
        rep["invariance"]["greedy_alone"] = alone
        rep["invariance"]["greedy_in_batch16"] = inb
        rep["invariance"]["greedy_same"] = alone == inb
        rep["invariance"]["greedy_logits_bitwise"] = same
        print(f"invariance: {rep['invariance']}", flush=True)

    if "ttft" not in skip and prompts:
        g = torch.Generator().manual_seed(3)
        hf = None
        if not a.no_hf:
            from bench.ttft_baseline import forward_ms
            from interp.hf import hf_config_kwargs, random_llama_on
            kw = hf_config_kwargs(cfg)
            kw["max_position_embeddings"] = max(kw["max_position_embeddings"], max(prompts) + 8)
            kw["attn_implementation"] = "sdpa"
            hf = random_llama_on(kw, "cuda", seed=0)
        for n in prompts:
            ids = torch.randint(0, cfg.vocab, (n,), generator=g)
            toks = ids.tolist()
            one = dec._pick(h, n)
            dstep = graph_step_ms(lambda: runtime.launch(one, h.x0, n, h.hidden), a.reps)
            for ci, c in enumerate(chunks):
                row = _ttft(h, toks, c or None, a.reps, dstep)
                if hf is not None and ci == 0:
                    hms = forward_ms(hf, ids.cuda().reshape(1, -1), a.reps)
                    hf_ms = statistics.median(hms)
                if hf is not None:
                    row.update(hf_ms=hf_ms, x_hf=hf_ms / row["prefill_ms"])
                if n <= 1024 and ci == 0:
                    kv_ref = [tuple(t[2:3].clone() for t in pair) for pair in kv]
                    kv32 = [tuple(t[2:3].float() for t in pair) for pair in kv]
                    lg = prefill(h, toks, 0, slot=2)
                    sl, ps = [0] * n, list(range(n))
                    ref = decoder_ref_rows(w, kv_ref, cfg, toks, sl, ps)[-1:]
                    ref32 = decoder_ref_rows_fp32(w, kv32, cfg, toks, sl, ps)[-1:]
                    acc = step_accuracy(lg, ref, ref32)
                    row.update(err=acc["err"], ref_err=acc["ref_err"], decisive=acc["decisive"], agree=acc["agree"])
                    del kv_ref, kv32
                rep["ttft"].append(row)
                print(f"TTFT prompt {n}" + (f", chunks of {c}" if c else "") + f": prefill {row['prefill_ms']:.2f} ms "
                      f"(median of {a.reps}; first call {row['first_call_s']:.1f} s) = {row['x_decode_steps']:.2f} "
                      f"decode steps of {row['decode_step_ms'] * 1e3:.0f} us"
                      + (f"; transformers {row['hf_ms']:.2f} ms ({row['x_hf']:.2f}x)" if "hf_ms" in row else "")
                      + (f"; err {row['err']:.3e} vs bf16 ref {row['ref_err']:.3e}" if "err" in row else ""), flush=True)
        del hf
    teardown(h)
    if a.out:
        d = pathlib.Path(a.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rows-{a.preset}.json").write_text(json.dumps(rep, indent=1))
    print(json.dumps({k: v for k, v in rep.items() if k in ("decode", "ttft", "invariance")}, indent=None)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
