"""Issue 51 on a GPU: the serving engine (``megatape.serve.Engine`` over the rows kernel, ``KernelBackend``)
under C concurrent clients, beside single-stream ``generate``. In process, without HTTP (the lent image
has no FastAPI / uvicorn): what the server's scheduler and kernel deliver, not the HTTP stack's cost.

    python -m bench.serve_bench [--preset llama3.2-1b] [--clients 1,8,32] [--prompt 128] [--new 64]
                                [--requests-per-client 2] [--out DIR]

Random weights of the preset (``bench.decoder_bench.make_decoder_weights``), random prompt ids, greedy,
every request runs its ``--new`` tokens (no EOS). Each client submits a request, waits for it to finish,
submits the next. Per concurrency: completion tokens/s over the wall time (all clients), TTFT (submit to
the first token's event) p50 / p99, per-request decode tokens/s. Single stream: ``generate`` (prefill
and CUDA-graph blocks) on a batch-1 handle, the same prompt and length. Writes serve-<preset>.json."""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import threading
import time

import torch


class IdTokenizer:
    """Token ids as text (the engine turns ids into text as they come; a real tokenizer is not the point here)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_bench", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench.serve_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.decoder_bench import make_decoder_weights
    from interp import build_decoder, generate, teardown
    from megatape.serve import Engine, KernelBackend, Request, Sampling
    from opcodes.config import ModelConfig
    from opcodes.reference import make_kv_cache

    cfg = ModelConfig.from_name(a.preset)
    clients = [int(c) for c in a.clients.split(",")]
    max_seq = -(-(a.prompt + a.new + 8) // 128) * 128
    w = make_decoder_weights(cfg, seed=0, device="cuda")
    g = torch.Generator().manual_seed(5)
    card = torch.cuda.get_device_name()
    rep = dict(card=card, preset=a.preset, prompt=a.prompt, new=a.new, http=False, runs=[])

    # single stream: generate on a batch-1 handle (prefill, then CUDA-graph blocks of launches)
    kv = make_kv_cache(cfg, max_seq, 0, device="cuda")
    h = build_decoder(w, kv, cfg, max_seq)
    prompt = torch.randint(0, cfg.vocab, (a.prompt,), generator=g).tolist()
    generate(h, prompt, a.new)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        generate(h, prompt, a.new)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    gen_s = statistics.median(times)
    rep["generate"] = dict(seconds=gen_s, tokens_per_s=a.new / gen_s)
    print(f"{card} {a.preset}: single-stream generate, {a.prompt}-token prompt + {a.new} new: {gen_s * 1e3:.1f} ms "
          f"({a.new / gen_s:.0f} tokens/s with the prompt)", flush=True)
    teardown(h)
    del kv

    backend = KernelBackend(w, cfg.to_dict(), max(clients), max_seq, device="cuda")
    engine = Engine(backend, IdTokenizer(), (), prefill_chunk=128, max_queue=1024, log=lambda line: None).start()
    # warm-up: builds the buckets every concurrency uses (16 and 32 rows, the prefill chunk)
    warm = [Request(prompt, 4, Sampling(temperature=0.0)) for _ in range(max(clients))]
    done = threading.Semaphore(0)
    for r in warm:
        r.sink = lambda ev, d=done: d.release() if ev.kind != "text" else None
        engine.submit(r)
    for _ in warm:
        done.acquire()
    for C in clients:
        ttft, dec, ntok = [], [], 0
        lock = threading.Lock()

        def client(k: int):
            nonlocal ntok
            for j in range(a.requests_per_client):
                ids = torch.randint(0, cfg.vocab, (a.prompt,), generator=torch.Generator().manual_seed(1000 * k + j))
                ev_done = threading.Event()
                stamp = {}

                def sink(ev, stamp=stamp, ev_done=ev_done):
                    now = time.perf_counter()
                    if ev.kind == "text" and "first" not in stamp:
                        stamp["first"] = now
                    if ev.kind in ("done", "error"):
                        stamp["end"], stamp["kind"], stamp["n"] = now, ev.kind, ev.completion_tokens
                        ev_done.set()
                req = Request(ids.tolist(), a.new, Sampling(temperature=0.0), sink=sink)
                t0 = time.perf_counter()
                engine.submit(req)
                ev_done.wait()
                if stamp["kind"] != "done":
                    raise RuntimeError(f"request failed: {req.text}")
                with lock:
                    ttft.append(stamp["first"] - t0)
                    dec.append((stamp["n"] - 1) / max(1e-9, stamp["end"] - stamp["first"]))
                    ntok += stamp["n"]

        th = [threading.Thread(target=client, args=(k,)) for k in range(C)]
        t = time.perf_counter()
        for x in th:
            x.start()
        for x in th:
            x.join()
        wall = time.perf_counter() - t
        run = dict(clients=C, requests=len(ttft), tokens=ntok, wall_s=wall, tokens_per_s=ntok / wall,
                   ttft_p50_ms=pct(ttft, 0.5) * 1e3, ttft_p99_ms=pct(ttft, 0.99) * 1e3,
                   decode_tokens_per_s_per_request_p50=pct(dec, 0.5), x_generate=(ntok / wall) / (a.new / gen_s))
        rep["runs"].append(run)
        print(f"{C} clients: {ntok} tokens in {wall:.2f} s = {ntok / wall:.0f} tokens/s ({run['x_generate']:.2f}x "
              f"single-stream generate); TTFT p50 {run['ttft_p50_ms']:.1f} ms, p99 {run['ttft_p99_ms']:.1f} ms; a "
              f"request decodes at {run['decode_tokens_per_s_per_request_p50']:.0f} tokens/s (p50)", flush=True)
    engine.shutdown()
    backend.close()
    if a.out:
        d = pathlib.Path(a.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"serve-{a.preset}.json").write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
