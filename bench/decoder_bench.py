"""``python -m bench decoder``: a whole model (embedding, layers, final norm, LM head) on the GPU.

Random weights in a real shape (default: Llama-3.2-1B; tied embeddings where the checkpoint ties them,
an LM head of its own where it does not: :data:`UNTIED`), KV cache prefilled with
``prefill`` positions. Checks every step's logits against the eager reference and the greedy
tokens of ``generate`` (one launch per token, no host round trip) against the reference's, then
times megatape's decode step and ``torch.compile`` (CUDA graphs) of the same model, and reports
tokens/s and x floor (bytes per step over the stream-copy bandwidth measured in the same run).

The arguments are parsed by ``bench.cli`` (``python -m bench decoder --help``), which calls
:func:`run`. Results go to ``<out>/decoder-<preset>.json`` and ``.md`` (default
``bench/results/latest/``).
"""
from __future__ import annotations

import datetime
import gzip
import json
import math
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

from opcodes import ModelConfig
from opcodes.reference import make_kv_cache, make_weights, rel_err, rmsnorm

from megatape.measure import ACC_RATIO, CRITERION, log

from .driver import _events_median, count_kernels, stream_copy_bw


#: presets whose checkpoints have an LM head of their own (config.json: tie_word_embeddings false);
#: Llama-3.2-1B ties it to the embedding. The bytes a step streams are the same either way
UNTIED = frozenset({"llama3.1-8b", "llama3.1-70b"})


#: the greedy check: ``generate`` from ``--pos`` on a prompt of GREEDY_PROMPT tokens, GREEDY_NEW new ones
#: (``python -m bench decoder`` sizes the KV cache for them)
GREEDY_PROMPT, GREEDY_NEW = 4, 16


def _parting(first: int | None, margin: float | None) -> str:
    """Where two greedy chains part, for the log and the report ('' where they do not)."""
    return "" if first is None else f" (the chains part at token {first}: a {margin:.2%} top-2 margin)"


def top2_margin(logits: torch.Tensor) -> float:
    """The gap between the two largest logits over the logits' standard deviation: how far a greedy
    pick is from a tie, in the logits' own scale (a small one is a near tie, after which two greedy
    chains each continue their own text)."""
    l = logits.reshape(-1).float()
    top2 = torch.topk(l, 2).values
    return float((top2[0] - top2[1]) / l.std())


def reference_greedy(w, kv_ref, cfg: ModelConfig, prompt: list, n_new: int, pos: int) -> tuple[list, list]:
    """The bf16 reference's greedy continuation of ``prompt`` (fed from ``pos``; ``kv_ref`` is written):
    its ``n_new`` tokens and, for each, :func:`top2_margin` of the logits it was picked from."""
    from opcodes.decoder import decoder_ref, greedy_token
    for i, t in enumerate(prompt):
        lg = decoder_ref(w, kv_ref, cfg, t, pos + i)
    toks, margins = [], []
    for i in range(n_new):
        tok = greedy_token(lg)
        toks.append(tok)
        margins.append(top2_margin(lg))
        lg = decoder_ref(w, kv_ref, cfg, tok, pos + len(prompt) + i)
    return toks, margins


def greedy_compare(got: list, ref: list, margins: list) -> tuple[int, int | None, float | None]:
    """How many of ``got``'s tokens equal ``ref``'s, the first index where they differ (None: none),
    and the reference's top-2 margin there."""
    same = sum(int(x == y) for x, y in zip(got, ref))
    first = next((i for i, (x, y) in enumerate(zip(got, ref)) if x != y), None)
    return same, first, None if first is None else margins[first]


def make_decoder_weights(cfg: ModelConfig, seed: int, device, tied: bool = True) -> dict:
    """Random weights of a whole model: the layers' (``make_weights``), a unit-normal embedding, the
    final norm, and the LM head: the embedding itself with ``tied``, else a tensor of its own
    (entries of standard deviation ``1 / sqrt(d)``).
    NOTE: with an untied random head most steps' top-2 margins are not decisive (the 8B, runs
    149-150: 11 of 32 steps, against 32 of 32 tied) and a 16-token greedy chain parts at its first
    near tie (6 of 16 tokens at pos 4096); a head 64x larger (run 150) changed neither, so it is the
    logits' shape, not their scale (with a tied head the input token's own embedding row is in the
    residual stream, which plausibly puts its logit far ahead)."""
    w = make_weights(cfg, seed=seed, device=device)
    g = torch.Generator(device=device).manual_seed(seed + 7)
    w["embed"] = torch.randn(cfg.vocab, cfg.d, generator=g, device=device).to(torch.bfloat16)
    w["final_norm"] = (1.0 + 0.1 * torch.randn(cfg.d, generator=g, device=device)).to(torch.bfloat16)
    if tied:
        w["lm_head"] = w["embed"]
    else:
        h = torch.randn(cfg.vocab, cfg.d, generator=g, device=device)
        w["lm_head"] = (h / math.sqrt(cfg.d)).to(torch.bfloat16)
    return w


def compiled_decoder(weights, kv_cache, cfg: ModelConfig, max_seq: int, mode="reduce-overhead"):
    """The whole model in one torch.compile'd module (gpt-fast style, static cache, CUDA graphs,
    the layers of ``bench.baselines.compiled_step``)."""
    from .baselines import _Model

    class _Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _Model(weights, kv_cache, cfg, max_seq, kv_cache[0][0].device)
            self.register_buffer("embed", weights["embed"], persistent=False)
            self.register_buffer("fnorm", weights["final_norm"], persistent=False)
            self.register_buffer("lm_head", weights["lm_head"], persistent=False)

        def forward(self, tok, input_pos):
            x = self.embed[tok].view(1, -1)
            h = rmsnorm(self.body(x, input_pos), self.fnorm, cfg.eps)
            return F.linear(h, self.lm_head).float()

    model = _Decoder().eval()
    fwd = torch.compile(model, mode=mode, fullgraph=True, dynamic=False)
    input_pos = torch.zeros(1, dtype=torch.int64, device=kv_cache[0][0].device)

    def step(tok: torch.Tensor, pos: int) -> torch.Tensor:
        input_pos.fill_(int(pos))
        with torch.no_grad():
            torch.compiler.cudagraph_mark_step_begin()
            return fwd(tok, input_pos).clone()
    return step


def check_steps(step, weights: dict, kv_ref: list, cfg: ModelConfig, toks: torch.Tensor, prefill: int) -> dict:
    """The accuracy of decode steps ``step(token (1,), pos) -> logits`` at ``prefill + i`` for the
    tokens ``toks``, against the bf16 eager reference (``kv_ref``: its cache, updated) and an
    all-fp32 one: the multi-layer criterion (at every step the error against fp32 is at most
    ``ACC_RATIO`` x the bf16 reference's own, and the greedy token agrees with fp32's wherever its
    top-2 margin is decisive, :func:`opcodes.decoder.step_accuracy`). Returns the summary, with the
    per-step errors against the bf16 reference under ``errs``."""
    from opcodes.decoder import decoder_ref, decoder_ref_fp32, step_accuracy
    kv32 = [tuple(t.float() for t in p) for p in kv_ref]
    errs, steps = [], []
    for i in range(len(toks)):
        pos = prefill + i
        lg = step(toks[i:i + 1], pos)
        ref = decoder_ref(weights, kv_ref, cfg, int(toks[i]), pos)
        errs.append(rel_err(lg, ref))
        steps.append(step_accuracy(lg, ref, decoder_ref_fp32(weights, kv32, cfg, int(toks[i]), pos)))
    dec = [s for s in steps if s["decisive"]]
    return dict(errs=errs, rel_err_vs_fp32_max=max(s["err"] for s in steps),
                bf16_ref_vs_fp32_max=max(s["ref_err"] for s in steps),
                criterion=CRITERION,
                criterion_met=all(s["err"] <= ACC_RATIO * s["ref_err"] for s in steps),
                decisive_steps=len(dec), greedy_agree_decisive=sum(s["agree"] for s in dec),
                greedy_agree_all=sum(s["agree"] for s in steps), steps=len(steps))


def table_rows(objs, tps_digits: int = 0) -> list[str]:
    """Markdown rows of the decoder tables (``name``, ``us_per_step``, ``us_wall``, ``x_floor``,
    ``fraction_of_bw``, ``kernels_per_step``; tokens/s with ``tps_digits`` decimals)."""
    out = []
    for o in objs:
        wl, k = o["us_wall"], o["kernels_per_step"]
        out.append(f"| {o['name']} | {o['us_per_step']:.1f} | {'-' if wl is None else format(wl, '.1f')} | "
                   f"{1e6 / o['us_per_step']:.{tps_digits}f} | {o['x_floor']:.3f} | {o['fraction_of_bw']:.1%} | "
                   f"{'-' if k is None else k} |")
    return out


def write_report(rep: dict, rows: list, out: pathlib.Path) -> tuple[pathlib.Path, str]:
    """Write ``decoder-<preset>-pos<P>.json`` / ``.md`` under ``out``: ``rep`` (``card``, ``date``,
    ``preset``, ``pos``, ``bytes_per_step``, ``copy_TBps``, ``floor_us``, ``accuracy``, ...) with
    ``rows`` as objects (``name``, ``us_per_step``, ``us_wall``, ``x_floor``, ``fraction_of_bw``,
    ``kernels_per_step``); ``rows`` are (name, event us, wall us or None, kernels or None, dominant
    or None) tuples, the floor first. Returns the JSON path and the Markdown text."""
    floor = rep["floor_us"]
    objs = [dict(name=n, us_per_step=e, us_wall=wl, x_floor=e / floor, fraction_of_bw=floor / e,
                 kernels_per_step=k) for n, e, wl, k, _ in rows]
    acc = rep["accuracy"]
    fp32 = "" if "rel_err_vs_fp32_max" not in acc else (
        f"; vs fp32 {acc['rel_err_vs_fp32_max']:.2e}, the bf16 reference {acc['bf16_ref_vs_fp32_max']:.2e} "
        f"({'criterion met' if acc['criterion_met'] else 'criterion NOT met'}); greedy = fp32's at "
        f"{acc['greedy_agree_decisive']}/{acc['decisive_steps']} decisive steps")
    md = [f"{rep['card']}, {rep['date']}, {rep['preset']} (random weights, {'tied embeddings' if rep.get('tied', True) else 'untied LM head'}), pos {rep['pos']}: "
          f"{rep['bytes_per_step']} bytes/step, stream copy {rep['copy_TBps']:.3f} TB/s; logits max rel err "
          f"{acc['logits_rel_err_max_vs_bf16_ref']:.2e} (vs the bf16 reference){fp32}; greedy {acc['greedy_same']}/"
          f"{acc['greedy_n']}{_parting(acc.get('greedy_first_diff'), acc.get('greedy_first_diff_margin'))}", "",
          "| what | us/step (events) | us/step (wall) | tokens/s | x floor | fraction of BW | kernels/step |",
          "|---|---|---|---|---|---|---|"]
    md += table_rows(objs)
    txt = "\n".join(md) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    stem = f"decoder-{rep['preset']}-pos{rep['pos']}"
    path = out / f"{stem}.json"
    path.write_text(json.dumps(dict(rep, rows=objs), indent=1, default=str))
    (out / f"{stem}.md").write_text(txt)
    print(txt)
    return path, txt


def run(a, views=None) -> int:
    """``python -m bench decoder`` after argument parsing (``a``: the namespace of ``bench.cli``;
    ``views``: ``megatape.views``, for ``--profile``)."""
    if not torch.cuda.is_available():
        print("python -m bench decoder needs a CUDA GPU", file=sys.stderr)
        return 2
    from interp.decoder import build_decoder, decode_step, generate
    from opcodes.decoder import decoder_ref
    cfg = ModelConfig.from_name(a.preset)
    if not cfg.vocab:
        raise SystemExit(f"--preset {a.preset}: has no vocabulary (not a whole model)")
    dev = torch.device("cuda")
    card = torch.cuda.get_device_name()
    bw = stream_copy_bw()
    pos_last = a.prefill + a.steps - 1
    bytes_step = cfg.bytes_per_step(pos_last)
    floor_us = bytes_step / bw * 1e6
    log(f"{card}; {cfg.name}: {bytes_step} bytes/step at pos {pos_last}; stream copy {bw / 1e12:.3f} TB/s; "
        f"floor {floor_us:.1f} us")
    tied = cfg.name not in UNTIED
    w = make_decoder_weights(cfg, a.seed, dev, tied=tied)
    kv = make_kv_cache(cfg, a.max_seq, a.prefill, seed=a.seed + 1, device=dev)
    kv_before = [tuple(t.clone() for t in p) for p in kv]
    kv_ref = [tuple(t.clone() for t in p) for p in kv]
    g = torch.Generator(device="cpu").manual_seed(a.seed + 3)
    toks = torch.randint(0, cfg.vocab, (a.steps,), generator=g)
    t0 = time.perf_counter()
    from .driver import parse_variant
    # --tiling takes what --variants takes: Tiling fields and build options (lm_rows, pool, ...)
    til, bkw = parse_variant(cfg, getattr(a, "tiling", ""), a.max_seq, none_if_default=True)
    dh = build_decoder(w, kv, cfg, a.max_seq, tiling=til, **bkw)
    log(f"built in {time.perf_counter() - t0:.1f} s: {len(dh.layer.tape)} instructions on {dh.layer.num_sms} SMs")
    acc = check_steps(lambda tk, p: decode_step(dh, tk.to(torch.int32).to(dev), p), w, kv_ref, cfg, toks, a.prefill)
    dh.layer.check()
    errs = acc.pop("errs")
    rep = {"card": card, "date": datetime.date.today().isoformat(), "preset": cfg.name, "tied": tied,
           "tiling": a.tiling or "default",
           "bytes_per_step": bytes_step,
           "stream_copy_Bps": bw, "floor_us": floor_us, "logits_rel_err_max": max(errs)}
    log(f"logits vs eager reference: max rel err {max(errs):.2e} over {a.steps} steps; vs fp32: "
        f"{acc['rel_err_vs_fp32_max']:.2e} (the bf16 reference {acc['bf16_ref_vs_fp32_max']:.2e}); criterion "
        f"{'met' if acc['criterion_met'] else 'NOT met'} ({acc['criterion']}); greedy agrees with fp32 at "
        f"{acc['greedy_agree_decisive']}/{acc['decisive_steps']} decisive steps")
    # greedy generation: one launch per token, the next token stays on the device
    for p, b in zip(kv, kv_before):
        p[0].copy_(b[0]); p[1].copy_(b[1])
    kv_ref = [tuple(t.clone() for t in p) for p in kv_before]
    n_new = GREEDY_NEW
    prompt = toks[:GREEDY_PROMPT].tolist()
    t0 = time.perf_counter()
    got = generate(dh, prompt, n_new, start_pos=a.prefill)
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    got = [int(t) for t in (got.tolist() if hasattr(got, "tolist") else got)][-n_new:]
    same, first, margin = greedy_compare(got, *reference_greedy(w, kv_ref, cfg, prompt, n_new, a.prefill))
    greedy = dict(greedy_same=same, greedy_n=n_new, greedy_first_diff=first, greedy_first_diff_margin=margin)
    rep.update(greedy, generate_s=gen_s)
    log(f"greedy: {same}/{n_new} tokens equal to the reference's{_parting(first, margin)} ({gen_s * 1e3:.1f} ms for "
        f"{len(prompt) + n_new} launches)")
    # timing
    args = [(dh, toks[i:i + 1].to(torch.int32).to(dev), a.prefill + i) for i in range(a.steps)]
    ev, wall, _ = _events_median(decode_step, args)
    nk, dom, _ = count_kernels(decode_step, args[0])
    rows = [("floor", floor_us, None, None, None), ("megatape", ev, wall, nk, dom)]
    from interp.decoder import teardown_decoder
    if a.profile:
        if views is None:
            raise ValueError("--profile needs the views: run it as 'python -m bench decoder --profile'")
        from interp.profile import format_kernel_span, kernel_span
        from interp.runtime import profile_records, profile_sm_records
        hp = build_decoder(w, kv, cfg, a.max_seq, tiling=til, profile=True, **bkw)
        for i in range(3):
            decode_step(hp, toks[i:i + 1].to(torch.int32).to(dev), pos_last)
        # this profiling build's own event time (its record stores make it slower than the main build),
        # so that its SMs' residency is compared with its own launches; the records are the last one's
        pargs = [(hp, toks[i:i + 1].to(torch.int32).to(dev), pos_last) for i in range(min(8, a.steps))]
        ev_p, _, _ = _events_median(decode_step, pargs)
        # the tape that ran at pos_last (a decoder of two runs its short one below short_until)
        ph = hp.short if hp.short is not None and pos_last < hp.short_until else hp.layer
        prof = profile_records(ph)
        summ = views.summarize(ph.tape, prof, pos=pos_last, copy_Bps=bw)
        span = dict(kernel_span(prof, profile_sm_records(ph)), events=ev_p)
        print(format_kernel_span(span, ev_p), flush=True)
        # every instruction's record, for offline critical-path analysis (the Markdown table is
        # medians only)
        from interp.profile import instruction_rows
        recs = summ.pop("records")
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        with gzip.open(out / f"records-{a.preset}-pos{pos_last}.json.gz", "wt") as f:
            json.dump(instruction_rows(ph.tape, recs), f)
        print(views.format_summary(summ), flush=True)
        rep["profile"] = dict(summ, kernel_span=span)
        teardown_decoder(hp)
    for v in filter(None, (x.strip() for x in a.variants.split(";"))):
        try:
            # 'default': the build's own choice, as the first row (no tiling: a second, short tape included)
            vt, vkw = (til, bkw) if v == "default" else parse_variant(cfg, v, a.max_seq)
            hv = build_decoder(w, kv, cfg, a.max_seq, tiling=vt, **vkw)
            lg = decode_step(hv, toks[:1].to(torch.int32).to(dev), a.prefill)
            # the first step against the reference (its cache rows >= prefill hold the reference's
            # own values from the check above; the step attends rows <= prefill only)
            err_v = rel_err(lg, decoder_ref(w, kv_ref, cfg, int(toks[0]), a.prefill))
            vargs = [(hv, toks[i:i + 1].to(torch.int32).to(dev), a.prefill + i) for i in range(a.steps)]
            ev_v, wall_v, _ = _events_median(decode_step, vargs)
            hv.layer.check()
            # deep models drift from the bf16 reference (32 layers of the 8B shape: ~3e-2 for the
            # default build too): a variant is wrong when it is much further than the default
            ok = err_v <= max(2.5e-2, 1.5 * errs[0])
            rows.append((f"megatape [{v}]" + ("" if ok else " (WRONG)"), ev_v, wall_v, 1, None))
            log(f"megatape [{v}]: {ev_v:.1f} us/step, {len(hv.layer.tape)} instructions, first-step logits "
                f"rel err {err_v:.2e}")
            teardown_decoder(hv)
        except Exception as e:
            log(f"variant {v} failed: {type(e).__name__}: {e}")
    if not a.no_compile:
        try:
            for p, b in zip(kv, kv_before):
                p[0].copy_(b[0]); p[1].copy_(b[1])
            cstep = compiled_decoder(w, kv, cfg, a.max_seq)
            cargs = [(toks[i:i + 1].to(dev), a.prefill + i) for i in range(a.steps)]
            lg = cstep(*cargs[0])
            ev_c, wall_c, _ = _events_median(cstep, cargs)
            nk_c, dom_c, _ = count_kernels(cstep, cargs[0])
            rows.append(("torch.compile reduce-overhead", ev_c, wall_c, nk_c, dom_c))
        except Exception as e:
            log(f"compile baseline failed: {type(e).__name__}: {e}")
        try:
            from .baselines import hf_generate_us
            us = hf_generate_us(cfg, dev, a.prefill, n_new=a.steps)
            # wall clock per generated token (the difference of two generate calls): no event timing
            rows.append(("transformers generate, static cache + torch.compile (wall, per token)", us, us, None, None))
            log(f"transformers generate: {us:.1f} us/token")
        except Exception as e:
            log(f"transformers generate baseline failed: {type(e).__name__}: {e}")
    rep.update(pos=a.prefill, copy_TBps=bw / 1e12,
               accuracy=dict(acc, logits_rel_err_max_vs_bf16_ref=max(errs), **greedy))
    write_report(rep, rows, pathlib.Path(a.out))
    return 0

