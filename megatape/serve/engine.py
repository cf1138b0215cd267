"""The scheduler of ``megatape serve``: continuous batching over a :class:`Backend` of B sequence slots.

    backend = RefBackend(weights, cfg, max_batch=8, max_seq=2048)     # or KernelBackend(...)
    engine = Engine(backend, tokenizer, eos_token_ids=[2], prefill_chunk=128, max_queue=256)
    engine.start()                                                   # the scheduler thread
    req = Request(prompt_ids, max_tokens=64, sampling=Sampling(temperature=0.0), stop=["\\n\\n"],
                  sink=print)                                         # sink(Event) from the scheduler thread
    engine.submit(req)                                               # QueueFull / Draining / ValueError
    ...
    engine.cancel(req)                                               # the client went away: frees its slot
    engine.shutdown()                                                # drain: finish what was accepted, join

One background thread runs the steps. Each step it

1. drops the requests cancelled since the last step (their slots are free again);
2. admits queued requests, oldest first, into free slots (up to ``backend.max_batch`` running);
3. runs at most one prefill chunk (``prefill_chunk`` prompt tokens of the oldest request still in its
   prompt, at its next prompt position): its last chunk's logits give the request's first token;
4. runs one ``backend.decode`` over every request that has a token to feed (one row each: its last
   token at its next position, in its slot);
5. picks each row's token: the greedy rows' (temperature 0) in one batched argmax where the logits are
   (the GPU for the kernel backend: ties to the lowest index; only their ids come to the host), the other
   rows on the host (:func:`sample_token`: softmax(logits / T) cut by top-k and top-p, drawn from the
   request's own ``torch.Generator`` seeded with its seed, so a request's tokens do not depend on the
   others), and
   turns the tokens into text with :class:`interp.textgen.TextStream` (stop strings, multi-byte
   characters whole), ending a request at an EOS id or a stop string (``finish_reason`` "stop") or
   after ``max_tokens`` ("length") and freeing its slot.

The text a request gets is what ``interp.textgen.generate_text`` makes of the same tokens: EOS not
printed, nothing from the first stop string on. Events go to the request's ``sink`` from the
scheduler thread (it must not block: the HTTP app hands them to its event loop).
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import secrets
import sys
import threading
import time
from typing import Callable, Protocol

import torch

from interp.textgen import TextStream


# ---- backends --------------------------------------------------------------------------------------
class Backend(Protocol):
    """What the engine runs a step on: B sequence slots of ``max_seq`` positions each (one KV cache).

    ``prefill(tokens, slot, start_pos, logits=True)``: the prompt tokens ``tokens`` of slot ``slot`` at
    positions ``start_pos, start_pos + 1, ...`` (their K/V written into the slot's cache); returns the fp32
    logits (vocab,) of the last one, or with ``logits`` False None (a chunk before the prompt's last: the
    kernel skips its LM head).
    ``decode(tokens, slots, pos)``: R independent rows, row r token ``tokens[r]`` of slot ``slots[r]`` at
    position ``pos[r]`` (its K/V written); returns fp32 logits (R, vocab), row r's next-token logits.
    Logits stay on the backend's device (the engine copies to the host only the rows it samples there).
    Row r's logits depend only on its slot's cache up to ``pos[r]`` and its token, not on the other rows.
    """

    name: str
    max_batch: int
    max_seq: int
    vocab: int

    def prefill(self, tokens: list[int], slot: int, start_pos: int, logits: bool = True) -> torch.Tensor | None: ...

    def decode(self, tokens: list[int], slots: list[int], pos: list[int]) -> torch.Tensor: ...

    def close(self) -> None: ...


def _zero_cache(cfg, max_batch: int, max_seq: int, device) -> list:
    return [tuple(torch.zeros(max_batch, cfg.n_kv, max_seq, cfg.hd, dtype=torch.bfloat16, device=device)
                  for _ in range(2)) for _ in range(cfg.layers)]


class RefBackend:
    """The torch reference of the batched decoder (``opcodes.decoder.decoder_ref_rows``): the semantics
    the batched kernel implements, on any device (CPU by default). A prefill chunk is rows of one slot at
    consecutive positions.

    ``row_calls`` (default True): a decode step runs each row as its own ``decoder_ref_rows`` call, so a
    row's logits are bitwise those its request gets alone. One call for all R rows (``row_calls=False``)
    is faster, but torch's GEMMs (oneDNN's bf16 kernels on the CPU) round a row's outputs differently
    depending on how many rows share the call: a 1-ulp bf16 difference in one K/V element, which the
    following steps amplify until a sampled token flips, so a request's text would depend on what else
    is in the batch."""

    name = "ref"

    def __init__(self, weights: dict, cfg, max_batch: int, max_seq: int, device="cpu", row_calls: bool = True):
        from opcodes import ModelConfig
        from opcodes.reference import rope_tables
        for name, v in (("max_batch", max_batch), ("max_seq", max_seq)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")
        self.cfg = ModelConfig.from_dict(cfg)
        self.weights = weights
        self.max_batch, self.max_seq, self.vocab = max_batch, max_seq, self.cfg.vocab
        self.device = torch.device(device)
        self.kv = _zero_cache(self.cfg, max_batch, max_seq, self.device)
        self.cos_sin = rope_tables(self.cfg, max_seq, device=self.device)
        self.row_calls = bool(row_calls)

    def _rows(self, tokens, slots, pos) -> torch.Tensor:
        from opcodes.decoder import decoder_ref_rows
        with torch.inference_mode():
            return decoder_ref_rows(self.weights, self.kv, self.cfg, list(tokens), list(slots), list(pos), self.cos_sin)

    def prefill(self, tokens: list[int], slot: int, start_pos: int, logits: bool = True) -> torch.Tensor | None:
        n = len(tokens)
        out = self._rows(tokens, [slot] * n, range(start_pos, start_pos + n))[-1]
        return out if logits else None

    def decode(self, tokens: list[int], slots: list[int], pos: list[int]) -> torch.Tensor:
        if not self.row_calls or len(tokens) == 1:
            return self._rows(tokens, slots, pos)
        if not len(tokens) == len(slots) == len(pos):
            raise ValueError(f"tokens, slots, pos: {len(tokens)}, {len(slots)} and {len(pos)} rows (one each a row)")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots: {list(slots)} names a slot twice (one row a sequence in a decode step)")
        return torch.cat([self._rows([t], [s], [p]) for t, s, p in zip(tokens, slots, pos)])

    def close(self) -> None:
        self.kv = None


def batched_kernel_available() -> bool:
    """Whether ``interp`` has the batched API :class:`KernelBackend` runs on (``interp.rows``: ``prefill``
    and a ``build_decoder`` that takes ``batch=``)."""
    import inspect

    import interp
    if not callable(getattr(interp, "prefill", None)):
        return False
    try:
        return "batch" in inspect.signature(interp.build_decoder).parameters
    except (TypeError, ValueError):
        return False


class KernelBackend:
    """The megakernel with B sequence slots (``interp.rows``): ``build_decoder(..., batch=B)``, a prompt
    chunk per ``prefill(h, tokens, start_pos, slot)`` (one rows launch per 128 tokens), the running
    requests' next tokens in one ``decode_step(h, tokens (R,), pos (R,), slots=(R,))`` launch. A row's logits
    must be bitwise the same whatever else runs: the columns of a tile are independent, and the decode
    buckets (``opcodes.rows.DECODE_BUCKETS``, 16 and 32 rows) are tiled alike but for N, with their feature
    sums in fp64 (Triton lays a sum out by the whole tile, so the buckets' fp32 trees differ:
    ``tests/test_kernels_compile.py::test_decode_buckets_sum_alike``), so with up to 32 slots a step runs in
    the smallest bucket that holds its rows; past 32 (buckets 64 to 1024 tile attention otherwise) every step
    runs in the bucket of all the slots. The logits stay on the GPU (the
    engine takes greedy tokens there and copies only sampled rows to the host).
    """

    name = "kernel"

    def __init__(self, weights: dict, cfg, max_batch: int, max_seq: int, device=None, prefill_chunk: int = 128,
                 log: Callable[[str], None] | None = None, **options):
        import interp
        from interp.rows import BUCKETS, bucket, decode_rows, rows_handle
        from opcodes import ModelConfig
        from opcodes.rows import DECODE_BUCKETS
        if not batched_kernel_available():
            raise RuntimeError("the kernel backend needs interp's batched API (prefill and "
                               "build_decoder(..., batch=B)), which this build does not have")
        if max_batch > BUCKETS[-1]:
            raise ValueError(f"max_batch: at most {BUCKETS[-1]} slots (the rows kernel's largest step), got {max_batch}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.cfg = ModelConfig.from_dict(cfg)
        self.max_batch, self.max_seq, self.vocab = max_batch, max_seq, self.cfg.vocab
        if self.device.type == "cpu" and not {"tiling", "lm_rows"} & set(options):    # the Triton interpreter
            from interp.textgen import interpreter_options
            options = {**interpreter_options(self.cfg), **options}
        kv = _zero_cache(self.cfg, max_batch, max_seq, self.device)
        self._d = interp
        self._decode_rows = decode_rows
        self.h = interp.build_decoder(weights, kv, self.cfg.to_dict(), max_seq, batch=max_batch, **options)
        self._min_rows = 1 if max_batch <= DECODE_BUCKETS[-1] else max_batch
        # every bucket a step may take (up to max_batch rows or a prefill chunk of ``prefill_chunk``, the
        # engine's), compiled now: built on first use, a bucket stalled every running stream for its compile
        # (~7 s on the GPU; run 279: 32 clients' TTFT p99 6.6 s)
        top = bucket(min(max(max_batch, prefill_chunk), BUCKETS[-1]))
        for b in [b for b in BUCKETS if b <= top]:
            t = time.perf_counter()
            rows_handle(self.h, b)
            if log is not None:
                log(f"the {b}-row kernel built in {time.perf_counter() - t:.1f} s")

    def prefill(self, tokens: list[int], slot: int, start_pos: int, logits: bool = True) -> torch.Tensor | None:
        out = self._d.prefill(self.h, list(tokens), start_pos=start_pos, slot=slot, logits=logits)
        return None if out is None else out.reshape(-1).float()

    def decode(self, tokens: list[int], slots: list[int], pos: list[int]) -> torch.Tensor:
        return self._decode_rows(self.h, list(tokens), list(pos), list(slots), min_rows=self._min_rows).float()

    def close(self) -> None:
        if getattr(self, "h", None) is not None:
            self._d.teardown(self.h)
            self.h = None


# ---- sampling ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sampling:
    """A request's sampling parameters (as the OpenAI API defines them, plus ``top_k``): temperature 0
    is greedy; ``top_k`` 0 and ``top_p`` 1 are off; ``seed`` None draws a fresh one."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise ValueError(f"temperature: expected a number >= 0, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k: expected an integer >= 0 (0: off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {p!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise ValueError(f"seed: expected an integer or None, got {s!r}")

    def generator(self) -> torch.Generator | None:
        if self.temperature == 0:
            return None
        seed = secrets.randbits(63) if self.seed is None else self.seed % (1 << 64)
        return torch.Generator().manual_seed(seed)


def sample_token(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> int:
    """One token from fp32 ``logits`` (vocab,): the argmax (ties to the lowest index) at temperature 0;
    else a draw from softmax(logits / temperature) restricted to the ``top_k`` largest logits (ties with
    the k-th kept) and then to the fewest most probable tokens whose probability reaches ``top_p`` (as
    transformers' warpers), with one uniform number from ``gen`` (inverse CDF over the sorted
    probabilities, in float64)."""
    x = logits.reshape(-1)
    if sampling.temperature == 0:
        return int(torch.argmax(x))
    x = x.double() / sampling.temperature
    if 0 < sampling.top_k < x.numel():
        kth = torch.topk(x, sampling.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=0)
    p, idx = torch.sort(probs, descending=True, stable=True)
    if sampling.top_p < 1:
        before = torch.cumsum(p, 0) - p                  # the mass of the more probable tokens
        p = p.masked_fill(before >= sampling.top_p, 0.0)  # the first token always stays
    cdf = torch.cumsum(p, 0)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u.reshape(1), right=True)[0])
    return int(idx[min(i, int(torch.count_nonzero(p)) - 1)])


# ---- requests and events --------------------------------------------------------------------------
@dataclasses.dataclass
class Event:
    """What a request's sink receives: ``text`` (a new piece), ``done`` (``finish_reason`` "stop" or
    "length"; the token counts) or ``error`` (``text`` says why; the request is over)."""

    kind: str
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class QueueFull(Exception):
    """The engine's queue holds ``max_queue`` requests: refused (HTTP 429)."""


class Draining(Exception):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class Request:
    """One generation: ``prompt_ids``, at most ``max_tokens`` new tokens, :class:`Sampling`, stop strings,
    and ``sink(Event)``. The engine fills in ``tokens`` (the new ids, an EOS that ended it included),
    ``text`` and ``finish_reason``."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, prompt_ids, max_tokens: int, sampling: Sampling | None = None, stop=(),
                 sink: Callable[[Event], None] | None = None):
        ids = list(prompt_ids)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompt_ids: expected a non-empty list of token ids, got {prompt_ids!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {max_tokens!r}")
        stop = [stop] if isinstance(stop, str) else list(stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
        self.id = next(Request._ids)
        self.prompt_ids = ids
        self.max_tokens = max_tokens
        self.sampling = sampling or Sampling()
        self.stop = stop
        self.sink = sink or (lambda ev: None)
        self.state = "new"           # queued, prefill, decode, done
        self.slot = -1
        self.prefilled = 0           # prompt tokens whose K/V are in the slot
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.cancelled = False
        self.stream: TextStream | None = None
        self.gen: torch.Generator | None = None

    @property
    def text(self) -> str:
        return self.stream.text if self.stream is not None else ""

    @property
    def next_pos(self) -> int:
        """The position of the token fed next (the last new token's)."""
        return len(self.prompt_ids) + len(self.tokens) - 1


# ---- the engine ------------------------------------------------------------------------------------
class Engine:
    """Continuous batching over ``backend`` (see the module docstring). Thread-safe: ``submit``,
    ``cancel``, ``drain``, ``stats`` and ``shutdown`` may be called from any thread; the steps run on
    the engine's own thread (``start``).

    ``prefill_chunk``: prompt tokens per prefill call (at most one such call per step, beside the
    decode of the running requests). ``max_queue``: requests waiting for a slot (beyond those the free slots
    take at the next step) before ``submit`` raises :class:`QueueFull`. ``step_delay_s``: a pause after every step (for demonstrations and tests that
    need requests to last; 0 in service). ``log``: a function of one line (stderr by default)."""

    def __init__(self, backend, tokenizer, eos_token_ids=(), *, prefill_chunk: int = 128, max_queue: int = 256,
                 step_delay_s: float = 0.0, log: Callable[[str], None] | None = None):
        for name, v, lo in (("prefill_chunk", prefill_chunk, 1), ("max_queue", max_queue, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}: expected an integer >= {lo}, got {v!r}")
        if not step_delay_s >= 0:
            raise ValueError(f"step_delay_s: expected a number >= 0, got {step_delay_s!r}")
        self.backend = backend
        self.tokenizer = tokenizer
        #: held around every use of the tokenizer (a Rust tokenizer is not safe to use from two threads at once)
        self.tokenizer_lock = threading.Lock()
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.step_delay_s = float(step_delay_s)
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._cv = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}          # slot -> request
        self._prefilling: collections.deque[Request] = collections.deque()   # admitted, prompt not done
        self._free = list(range(backend.max_batch))      # a heap: the lowest free slot first
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self.counts = collections.Counter()   # submitted, finished, cancelled, refused, failed, steps, peak_running

    # -- from any thread --
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="megatape-engine", daemon=True)
            self._thread.start()
        return self

    def check(self, req: Request) -> None:
        """ValueError naming what does not fit: a token id outside the vocabulary, prompt + max_tokens
        past the context (``backend.max_seq`` positions)."""
        V, S = self.backend.vocab, self.backend.max_seq
        bad = [t for t in req.prompt_ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:4]} are outside the model's vocabulary [0, {V})")
        P = len(req.prompt_ids)
        if P + req.max_tokens > S:
            raise ValueError(f"max_tokens: the context is {S} tokens, the request asks for {P + req.max_tokens} "
                             f"({P} in the prompt, {req.max_tokens} in the completion)")

    def submit(self, req: Request) -> None:
        """Queue ``req`` (it runs when a slot is free). Raises :class:`Draining`, :class:`QueueFull` or
        ValueError (:meth:`check`); then nothing was queued."""
        self.check(req)
        with self._cv:
            if not self._accepting:
                self.counts["refused"] += 1
                raise Draining("the server is shutting down")
            if len(self._queue) >= self.max_queue + len(self._free):    # (a free slot takes one at the next step)
                self.counts["refused"] += 1
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting for "
                                f"{self.backend.max_batch} slots)")
            if req.state != "new":
                raise ValueError(f"request {req.id} was submitted before")
            req.state = "queued"
            self._queue.append(req)
            self.counts["submitted"] += 1
            self._cv.notify_all()

    def cancel(self, req: Request) -> None:
        """The client is gone: drop ``req`` from the queue, or free its slot before the next step. No
        more events are sent to it. A finished request is left alone."""
        with self._cv:
            if req.state in ("done", "new") or req.cancelled:
                return
            req.cancelled = True
            if req.state == "queued":
                self._queue.remove(req)
                req.state = "done"
                self.counts["cancelled"] += 1
            self._cv.notify_all()

    def drain(self) -> None:
        """Take no new requests (``submit`` raises :class:`Draining`); those accepted still run."""
        with self._cv:
            self._accepting = False
            self._cv.notify_all()

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stats(self) -> dict:
        with self._cv:
            return dict(running=len(self._running), queued=len(self._queue), slots=self.backend.max_batch,
                        free_slots=len(self._free), accepting=self._accepting,
                        **{k: self.counts[k] for k in ("submitted", "finished", "cancelled", "refused", "failed",
                                                       "steps", "peak_running")})

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> bool:
        """Drain, then (``wait``) run until every accepted request is done and stop the thread; without
        ``wait``, cancel everything and stop after the current step. True if the thread has ended."""
        with self._cv:
            self._accepting = False
            self._stop = True
            if not wait:
                for r in list(self._queue) + list(self._running.values()):
                    r.cancelled = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    # -- the engine thread --
    def _loop(self) -> None:
        while True:
            try:
                if not self._iteration():
                    return
            except Exception as e:      # a bug here must not leave the clients waiting: fail what runs, go on
                with self._cv:
                    reqs = list(self._running.values())
                self._fail(reqs, e)

    def _iteration(self) -> bool:
        """One step (or a wait for work); False when the engine has stopped."""
        with self._cv:
            while not (self._queue or self._running) and not self._stop:
                self._cv.wait()
            self._reap_cancelled()
            if self._stop and not (self._queue or self._running):
                return False
            self._admit()
            prefill = self._prefilling[0] if self._prefilling else None
            decode = [r for r in self._running.values() if r.state == "decode"]
        if prefill is None and not decode:
            return True
        self._step(prefill, decode)
        self.counts["steps"] += 1
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return True

    def _reap_cancelled(self) -> None:
        """(under the lock) Free the slots of cancelled requests; drop cancelled ones still queued (``cancel``
        removes them at once; ``shutdown(wait=False)`` only marks them)."""
        for r in [r for r in self._running.values() if r.cancelled]:
            self._release(r)
            self.counts["cancelled"] += 1
        for r in [r for r in self._queue if r.cancelled]:
            self._queue.remove(r)
            r.state = "done"
            self.counts["cancelled"] += 1

    def _admit(self) -> None:
        while self._queue and self._free:
            r = self._queue.popleft()
            r.slot = heapq.heappop(self._free)
            r.state = "prefill"
            r.stream = TextStream(self.tokenizer, r.stop)
            r.gen = r.sampling.generator()
            self._running[r.slot] = r
            self._prefilling.append(r)
        self.counts["peak_running"] = max(self.counts["peak_running"], len(self._running))

    def _release(self, r: Request) -> None:
        """(under the lock) Free ``r``'s slot."""
        if self._running.get(r.slot) is r:
            del self._running[r.slot]
            heapq.heappush(self._free, r.slot)
        if r in self._prefilling:
            self._prefilling.remove(r)
        r.state = "done"

    def _send(self, r: Request, ev: Event) -> None:
        if r.cancelled:
            return
        try:
            r.sink(ev)
        except Exception as e:       # a sink that cannot take it: the client is gone
            self.log(f"megatape serve: request {r.id}: its sink failed ({type(e).__name__}: {e}); cancelled")
            r.cancelled = True

    def _step(self, prefill: Request | None, decode: list[Request]) -> None:
        rows: list[tuple[Request, torch.Tensor]] = []
        try:
            if prefill is not None:
                start = prefill.prefilled
                chunk = prefill.prompt_ids[start:start + self.prefill_chunk]
                last = start + len(chunk) == len(prefill.prompt_ids)      # only the prompt's last chunk's logits
                logits = self.backend.prefill(chunk, prefill.slot, start, logits=last)
                prefill.prefilled += len(chunk)
                if last:
                    rows.append((prefill, logits.reshape(-1)))
            if decode:
                logits = self.backend.decode([r.tokens[-1] for r in decode], [r.slot for r in decode],
                                             [r.next_pos for r in decode])
                rows += list(zip(decode, logits))
            rows = [(r, lg) for r, lg in rows if not r.cancelled]
            # the greedy rows' tokens: one argmax over all of them where the logits are, their ids to the
            # host (32 rows' logits were 16 MB a step, and 32 host argmaxes over 128K logits ~4-12 ms)
            greedy = [i for i, (r, _) in enumerate(rows) if r.sampling.temperature == 0]
            ids = torch.argmax(torch.stack([rows[i][1] for i in greedy]), dim=-1).tolist() if greedy else []
        except Exception as e:
            self._fail([r for r in ([prefill] if prefill is not None else []) + decode], e)
            return
        picked = dict(zip(greedy, ids))
        for i, (r, lg) in enumerate(rows):
            if r.cancelled:                     # since the step began (a client went away)
                continue
            try:
                tok = picked[i] if i in picked else sample_token(lg.float().cpu(), r.sampling, r.gen)
                self._take(r, tok)
            except Exception as e:
                self._fail([r], e)

    def _take(self, r: Request, tok: int) -> None:
        """Append the new token ``tok`` to ``r``: stream its text; finish at EOS, a stop string or max_tokens."""
        first = not r.tokens
        r.tokens.append(tok)
        if first:
            with self._cv:
                if r in self._prefilling:
                    self._prefilling.remove(r)
                r.state = "decode"
        reason = None
        if tok in self.eos:
            reason = "stop"
        else:
            with self.tokenizer_lock:
                piece = r.stream.push(tok)
            if piece:
                self._send(r, Event("text", piece))
            if r.stream.stopped:
                reason = "stop"
        if reason is None and len(r.tokens) >= r.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(r, reason)

    def _finish(self, r: Request, reason: str) -> None:
        with self.tokenizer_lock:
            rest = r.stream.finish()
        if rest:
            self._send(r, Event("text", rest))
        r.finish_reason = reason
        # counted and its slot freed before the client hears "done": a client that reads /health after its
        # last event sees its request finished (sent first, the count raced the client: a flaky test in s40)
        with self._cv:
            if not r.cancelled:
                self.counts["finished"] += 1
            else:
                self.counts["cancelled"] += 1
            self._release(r)
        self._send(r, Event("done", finish_reason=reason, prompt_tokens=len(r.prompt_ids),
                            completion_tokens=len(r.tokens)))

    def _fail(self, reqs: list[Request], e: Exception) -> None:
        msg = f"{type(e).__name__}: {e}"
        self.log(f"megatape serve: a step failed for request(s) {[r.id for r in reqs]}: {msg}")
        for r in reqs:
            with self._cv:                      # counted before the client hears of it (as in _finish)
                self.counts["failed"] += 1
                self._release(r)
            self._send(r, Event("error", text=f"the generation failed: {msg}", prompt_tokens=len(r.prompt_ids),
                                completion_tokens=len(r.tokens)))
