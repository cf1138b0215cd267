"""``python -m bench layer``: build, check and time everything in one process on the GPU.

Follows the spec's protocol: KV cache prefilled with ``prefill`` positions; ``steps`` decode steps at
pos = prefill .. prefill+steps-1, a fresh x each step; every step compared with the eager reference
running on its own copy of the cache; the cache compared after the run (written rows close to the
reference's, every other row bitwise untouched: ``megatape.measure.check_megatape``); kernels per
step counted with torch.profiler; the floor is bytes per step over the stream-copy bandwidth
measured in the same run (``megatape.measure.stream_copy_bandwidth``).

The arguments are parsed by ``bench.cli`` (``python -m bench layer --help``), which calls :func:`run`.
Results go to ``<out>/<preset>[-<tag>].json`` and ``.md`` (default ``bench/results/latest/``).
"""
from __future__ import annotations

import datetime
import json
import pathlib
import statistics
import sys
import time

import torch

from megatape.measure import check_megatape, log, setup, stream_copy_bandwidth, time_step
from opcodes import ModelConfig, Tiling
from schedule import CostModel
from schedule.compile import POLICIES

from .baselines import count_kernels as _count_kernels


def _events_median(fn, args_list, warmup: int = 3):
    """(median CUDA-event us, median wall-clock us with a host sync per call, all event us) of
    fn(*args) over args_list (``megatape.measure.time_step``)."""
    r = time_step(fn, args_list, warmup=warmup)
    return r["us_event"], r["us_wall"], r["all_event"]


def count_kernels(fn, args) -> tuple[int, float, list]:
    """(kernels launched by one call, dominant kernel's share of GPU time, their names)."""
    n, dom, names = _count_kernels(fn, args, return_names=True)
    return n, dom, [name for name, _ in names]


def stream_copy_bw() -> float:
    """Bytes/s of a large device-to-device copy, read + write counted (median)."""
    return stream_copy_bandwidth(torch.device("cuda"))


BUILD_KEYS = {"coop": "cooperative", "elide": "elide_waits"}
#: variant keys that are integer build options (the decoder's tile sizes)
INT_BUILD_KEYS = ("lm_rows", "emb_cols")
#: variant keys that pick the cost model ordering the queues (value 1)
MODEL_KEYS = {"attnmodel": CostModel, "bytesmodel": CostModel.bytes_only}


def _number(key: str, v: str, conv=int):
    try:
        return conv(v)
    except ValueError:
        raise ValueError(f"--tiling/--variants: {key} takes a number, got {v!r}") from None


def parse_variant(cfg: ModelConfig, spec: str, max_seq: int | None = None,
                  none_if_default: bool = False) -> tuple[Tiling | None, dict]:
    """'bk=512,stages=3,coop=0,policy=round-robin' -> (Tiling with overrides, build_layer keyword
    arguments). ``max_seq``: the cache the build will have (``Tiling.for_config``'s).
    ``none_if_default``: the tiling is None where ``spec`` names no Tiling field (build options only),
    so a decoder build keeps its own choice (its second, short tape among it)."""
    tiling, build = [], {}
    for kv in filter(None, spec.replace(" ", "").split(",")):
        k, _, v = kv.partition("=")
        if not v:
            raise ValueError(f"--tiling/--variants: expected name=value, got {kv!r}")
        if k == "policy":
            if v not in POLICIES:
                raise ValueError(f"--tiling/--variants: policy must be one of {', '.join(POLICIES)}, got {v!r}")
            build["policy"] = v
        elif k == "pool":
            build["pool_us"] = _number(k, v, float)
        elif k in MODEL_KEYS:
            if _number(k, v):
                build["cost_model"] = MODEL_KEYS[k]()
        elif k in BUILD_KEYS:
            build[BUILD_KEYS[k]] = bool(_number(k, v))
        elif k in INT_BUILD_KEYS:
            build[k] = _number(k, v)
        else:
            tiling.append(kv)            # a Tiling field
    if none_if_default and not tiling:
        return None, build
    return Tiling.from_spec(cfg, ",".join(tiling), max_seq=max_seq), build


def parse_tiling(cfg: ModelConfig, spec: str) -> Tiling:
    return parse_variant(cfg, spec)[0]


def host_breakdown(h, x, pos, n: int = 20) -> dict:
    """Median host microseconds of the pieces of layer_step (argument checks, output allocation,
    the launch itself)."""
    from interp.common import check_step_args
    from interp.runtime import launch
    parts = {"checks": lambda: check_step_args(h, x, pos),
             "status": lambda: h.check(sync=False),
             "alloc (after the launch)": lambda: torch.empty(1, h.cfg.d, dtype=torch.bfloat16, device=h.device),
             "launch": lambda: launch(h, x, pos, torch.empty(1, h.cfg.d, dtype=torch.bfloat16, device=h.device))}
    out = {}
    for k, f in parts.items():
        ts = []
        for _ in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e6)
        out[k] = statistics.median(ts)
    torch.cuda.synchronize()
    return out


def host_us(fn, args_list) -> float:
    """Median host-side microseconds of one call (launch cost as the caller's thread sees it)."""
    ts = []
    for a in args_list:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*a)
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def run(a, views=None) -> int:
    """``python -m bench layer`` after argument parsing (``a``: the namespace of ``bench.cli``).
    ``views``: what turns a profiling launch into summaries and pictures (``megatape.views``,
    passed in by the command line; needed for ``--profile`` / ``--profile-variants``)."""
    if (a.profile or a.profile_variants) and views is None:
        raise ValueError("--profile needs the views: run it as 'python -m bench layer --profile'")
    if not torch.cuda.is_available():
        print("python -m bench layer needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    cfg = ModelConfig.from_name(a.preset)
    if a.layers:
        cfg = cfg.with_layers(a.layers)
    tiling = parse_tiling(cfg, a.tiling)
    card = torch.cuda.get_device_name()
    log(f"{card}; torch {torch.__version__}; preset {cfg.name}; tiling {tiling}")
    stem = f"{cfg.name}{('-' + a.tag) if a.tag else ''}"
    rep: dict = {"card": card, "date": datetime.date.today().isoformat(), "preset": cfg.name,
                 "cfg": cfg.to_dict(), "tiling": tiling.__dict__, "torch": torch.__version__}
    bw = stream_copy_bw()
    bytes_step = cfg.spec_bytes_per_step(a.prefill, a.steps)
    floor_us = bytes_step / bw * 1e6
    rep.update(stream_copy_Bps=bw, bytes_per_step=bytes_step, floor_us=floor_us)
    log(f"stream copy {bw / 1e12:.3f} TB/s; {bytes_step} bytes/step; floor {floor_us:.1f} us")
    rows = [dict(name="floor (bytes / stream-copy BW)", us_event=floor_us, us_wall=None, kernels=None, dominant=None)]

    from interp import build_layer, layer_step, teardown
    weights, kv, kv_before, xs = setup(cfg, a.prefill, a.steps, a.max_seq, a.seed)
    variants = [("megatape", parse_variant(cfg, a.tiling))] + [
        (f"megatape [{v.strip()}]", parse_variant(cfg, v)) for v in a.variants.split(";") if v.strip()]
    rep["variants"] = {}

    def profiled(vt, vpolicy, bkw):
        """A profiling build of a variant, four launches at the last step's position, summarised."""
        from interp.runtime import profile_records
        hp = build_layer(weights, kv, cfg.to_dict(), a.max_seq, tiling=vt, policy=vpolicy, profile=True, **bkw)
        for i in range(4):
            layer_step(hp, xs[i], a.prefill + a.steps - 1)
        hp.check()
        return hp, views.summarize(hp.tape, profile_records(hp), pos=a.prefill + a.steps - 1, copy_Bps=bw)

    for vname, (vt, bkw) in variants:
        vrep: dict = {"tiling": vt.__dict__}
        rep["variants"][vname] = vrep
        try:
            t0 = time.perf_counter()
            bkw = dict(bkw)
            vpolicy = bkw.pop("policy", a.policy)
            h = build_layer(weights, kv, cfg.to_dict(), a.max_seq, tiling=vt, policy=vpolicy, **bkw)
            vrep.update(build_s=time.perf_counter() - t0, instructions=len(h.tape), num_sms=h.num_sms,
                        resources=h.resources)
            log(f"{vname}: built {len(h.tape)} instructions on {h.num_sms} SMs in {vrep['build_s']:.1f}s; "
                f"{h.resources}")
            check_megatape(cfg, h, weights, kv, kv_before, xs, a.prefill, vrep,
                           fp32_ref=a.fp32_ref or cfg.layers > 1)
            step_args = [(h, xs[i], a.prefill + i) for i in range(a.steps)]
            ev, wall, allev = _events_median(layer_step, step_args)
            h.check()
            nk, dom, names = count_kernels(layer_step, step_args[0])
            vrep.update(us_event=ev, us_wall=wall, all_event=allev, kernels=nk, dominant=dom,
                        host_us=host_us(layer_step, step_args[:8]))
            pred = h.predicted_makespan_s * 1e6 if getattr(h, "predicted_makespan_s", None) else None
            vrep["predicted_us"] = pred
            rows.append(dict(name=vname + ("" if vrep["correct"] else " (WRONG)"), us_event=ev, us_wall=wall,
                             kernels=nk, dominant=dom, predicted=pred))
            vrep["host_breakdown"] = host_breakdown(h, xs[0], a.prefill)
            h.check()
            log(f"{vname}: {ev:.1f} us/step (events), {wall:.1f} us wall, host {vrep['host_us']:.1f} us/call "
                f"{ {k: round(v, 1) for k, v in vrep['host_breakdown'].items()} }, "
                f"{nk} kernel(s), dominant {dom:.3f}")
            teardown(h)
            if a.profile_variants and not (a.profile and vname == "megatape"):
                hp, summ = profiled(vt, vpolicy, bkw)
                vrep["timeline"] = views.timeline_line(summ)
                log(f"{vname} profiled: {vrep['timeline']}")
                teardown(hp)
            if a.profile and vname == "megatape":
                hp, summ = profiled(vt, vpolicy, bkw)
                recs = summ.pop("records")
                vrep["profile"] = summ
                txt = views.format_summary(summ)
                print(txt, flush=True)
                out = pathlib.Path(a.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / "profile.md").write_text(txt + "\n")
                (out / "profile_records.json").write_text(json.dumps(recs))
                try:
                    from schedule.compile import compile_model
                    comp = compile_model(cfg, hp.num_sms, max_seq=a.max_seq, tiling=vt, policy=vpolicy,
                                         model=bkw.get("cost_model"), pool_us=bkw.get("pool_us"))
                    views.write_views(recs, comp.prog, comp.sched, out, hp.num_sms)
                    print((out / "measured_vs_plan.md").read_text(), flush=True)
                except Exception as e:      # the views are extra; never lose the numbers over them
                    log(f"measured views failed: {type(e).__name__}: {e}")
                # profiling off vs on, same run
                ev_p, _, _ = _events_median(layer_step, [(hp, xs[i], a.prefill + i) for i in range(a.steps)])
                vrep["us_event_profiled"] = ev_p
                log(f"profiling on: {ev_p:.1f} us/step vs {ev:.1f} off")
                teardown(hp)
        except Exception as e:
            import traceback
            traceback.print_exc()
            log(f"{vname} failed: {type(e).__name__}: {e}")
            rows.append(dict(name=f"{vname} (failed)", us_event=None, us_wall=None, kernels=None, dominant=None))
    main_rep = rep["variants"]["megatape"]
    for k in ("rel_err_max", "correct", "kv_untouched_bitwise", "kv_rows_rel_err"):
        rep[k] = main_rep.get(k)

    for b in filter(None, a.baselines.split(",")):
        try:
            import bench.baselines as B
            if b == "eager":
                fn = B.eager_step(weights, kv, cfg)
            elif b == "compile":
                fn = B.compiled_step(weights, kv, cfg, a.max_seq, mode="reduce-overhead")
            elif b == "cublas":
                fn = B.cublas_gemv_graph(weights, cfg)
            else:
                raise ValueError(f"unknown baseline {b!r}")
            args = [(xs[i], a.prefill + i) for i in range(a.steps)]
            ev_b, wall_b, _ = _events_median(fn, args)
            nk_b, dom_b, _ = count_kernels(fn, args[0])
            rows.append(dict(name=b, us_event=ev_b, us_wall=wall_b, kernels=nk_b, dominant=dom_b))
            log(f"{b}: {ev_b:.1f} us/step, {wall_b:.1f} wall, {nk_b} kernels")
        except Exception as e:       # a baseline failing must not hide megatape's numbers
            log(f"baseline {b} failed: {type(e).__name__}: {e}")
            rows.append(dict(name=f"{b} (failed)", us_event=None, us_wall=None, kernels=None, dominant=None))
    for r in rows:
        if r["us_event"]:
            r["tokens_s"] = 1e6 / r["us_event"]
            r["x_floor"] = r["us_event"] / floor_us
    rep["rows"] = rows
    md = table(rows, rep)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(rep, indent=1, default=str))
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0 if rep["correct"] else 1


def table(rows, rep) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    err = rep.get("rel_err_max")
    lines = [f"{rep['card']}, {rep['date']}, {rep['preset']}: stream copy {rep['stream_copy_Bps'] / 1e12:.3f} TB/s, "
             f"{rep['bytes_per_step']} bytes/step; megatape max rel err "
             f"{'-' if err is None else format(err, '.2e')} ({'PASS' if rep.get('correct') else 'FAIL'})", "",
             "| what | us/step (events) | us/step (wall, synced) | tokens/s | x floor | kernels/step | dominant | predicted us |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {f(r['us_event'], '.1f')} | {f(r.get('us_wall'), '.1f')} | "
                     f"{f(r.get('tokens_s'), '.0f')} | {f(r.get('x_floor'), '.3f')} | {f(r.get('kernels'), 'd')} | "
                     f"{f(r.get('dominant'), '.3f')} | {f(r.get('predicted'), '.1f')} |")
    return "\n".join(lines) + "\n"

