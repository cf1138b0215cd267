"""``megatape serve``: the real server (``python -m megatape serve --backend ref`` in a subprocess, on
127.0.0.1, a free port) over the tiny checkpoint of ``tests/tiny_checkpoint.py``, talked to with the
official ``openai`` client (raw HTTP where the client cannot send what is tested: malformed JSON).

* greedy text equals ``megatape generate``'s (the B=1 kernel) on the same checkpoint; the chat endpoint
  is the chat template's prompt; streamed pieces add up to the whole text;
* 16 concurrent streams (greedy and seeded sampling, prompts longer than a prefill chunk, a stop string)
  all complete and each equals its request run alone;
* a client that disconnects (mid-stream, or while waiting for a whole completion) frees its slot;
* malformed JSON, an unknown model, max_tokens past the context, bad parameters: 4xx OpenAI JSON errors,
  and the server keeps serving;
* overload: requests past the queue get 429 (OpenAI's JSON), the accepted ones complete;
* SIGTERM: the running and queued requests finish, nothing new is taken, exit status 0;
* a load of 200 requests from 64 clients (1000 with --runslow) loses nothing;
* the engine without HTTP: host sampling (greedy ties, top-k / top-p, the seeded draw's frequencies),
  chunked prefill equals one chunk, at most one prefill chunk a step beside the decodes, a failing
  backend answers an error and the engine keeps going; the app answers 503 while draining;
* the README's client snippet runs against the server; the command line's errors are one line.

Two servers start at once (module fixtures): ``fast`` (16 slots, prefill chunks of 4 tokens) and
``slow`` (2 slots, a queue of 2, 20 ms a step: requests last long enough to disconnect, overload and
drain them deterministically).
"""
from __future__ import annotations

import json
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tiny_checkpoint import N_NEW, PROMPT, save_tiny_checkpoint  # noqa: E402

from megatape.serve import Engine, RefBackend, Request, Sampling, sample_token  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "tiny"
CONTEXT = 256            # max_position_embeddings of the served checkpoint (the weights do not depend on it)
START_S = 300            # a server's start (imports, the checkpoint) on a loaded 2-core machine: a bound, not a wait


# ---- the servers ---------------------------------------------------------------------------------
class Server:
    """``python -m megatape serve`` in a subprocess; its stderr lines in ``lines``."""

    def __init__(self, model_dir, *args):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "megatape", "serve", "--model", str(model_dir),
                                      "--port", "0", "--backend", "ref", "--model-name", MODEL, *map(str, args)],
                                     cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._port: queue.Queue = queue.Queue()
        self.url = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self._port.put(int(m.group(1)))
        self._port.put(None)

    def ready(self) -> "Server":
        port = self._port.get(timeout=START_S)
        assert port is not None, "the server exited before listening:\n" + "\n".join(self.lines)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def client(self, **kw):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120, **kw)

    def health(self) -> tuple[int, dict]:
        return http(self.url + "/health")

    def wait_health(self, cond, what: str, timeout: float = 60):
        """Poll /health until ``cond(stats)`` (the server's state changes asynchronously)."""
        end = time.monotonic() + timeout
        while True:
            st = self.health()[1]
            if cond(st):
                return st
            assert time.monotonic() < end, f"/health never showed {what}: {st}"
            time.sleep(0.02)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def http(url: str, body=None, method=None) -> tuple[int, dict]:
    """(status, JSON) of a raw request; ``body``: bytes sent as is, or an object sent as JSON."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-serve")
    save_tiny_checkpoint(path, max_position_embeddings=CONTEXT)
    return path


@pytest.fixture(scope="module")
def servers(ckpt):
    """Both servers, started together (their starts overlap)."""
    fast = Server(ckpt, "--max-batch", 16, "--max-queue", 1024, "--prefill-chunk", 4)
    slow = Server(ckpt, "--max-batch", 2, "--max-queue", 2, "--step-delay-ms", 20)
    try:
        yield fast.ready(), slow.ready()
    finally:
        fast.stop()
        slow.stop()


@pytest.fixture(scope="module")
def fast(servers):
    return servers[0]


@pytest.fixture(scope="module")
def slow(servers):
    return servers[1]


@pytest.fixture(scope="module")
def checkpoint(ckpt):
    from interp.textgen import Checkpoint
    return Checkpoint.open(ckpt)


def completion(client, prompt, stream=False, **kw):
    """(text, finish_reason, usage) of one completion, streamed or not."""
    kw.setdefault("max_tokens", 12)
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, **kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    parts, reason, usage = [], None, None
    for c in client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                       stream_options={"include_usage": True}, **kw):
        if c.choices:
            parts.append(c.choices[0].text)
            reason = c.choices[0].finish_reason or reason
        if c.usage is not None:
            usage = c.usage
    return "".join(parts), reason, usage


# ---- greedy text: megatape generate's ------------------------------------------------------------
def test_models_and_health(fast):
    ids = [m.id for m in fast.client().models.list().data]
    assert ids == [MODEL]
    status, st = fast.health()
    assert status == 200 and st["status"] == "ok" and st["slots"] == 16


def test_greedy_text_equals_megatape_generate(fast, ckpt, checkpoint, capsys):
    from megatape import cli
    rc = cli.main(["generate", "--model", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", str(N_NEW)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip()
    client = fast.client()
    text, reason, usage = completion(client, PROMPT, max_tokens=N_NEW, temperature=0)
    assert text == out
    assert reason == "length"
    P = len(checkpoint.encode(PROMPT))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (P, N_NEW, P + N_NEW)
    assert completion(client, PROMPT, stream=True, max_tokens=N_NEW, temperature=0)[:2] == (out, "length")
    # token ids as the prompt: the same
    ids = checkpoint.encode(PROMPT)
    assert completion(client, ids, max_tokens=N_NEW, temperature=0)[0] == out


def test_chat_is_the_chat_templates_prompt(fast, checkpoint):
    client = fast.client()
    msgs = [{"role": "user", "content": "hi é"}]
    ids = checkpoint.encode("hi é", chat=True)
    want = completion(client, ids, max_tokens=10, temperature=0)[0]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    # no max_tokens: the rest of the context
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0)
    assert r.usage.completion_tokens + r.usage.prompt_tokens == CONTEXT or r.choices[0].finish_reason == "stop"


# ---- 16 concurrent streams: each its text alone ---------------------------------------------------
PROMPTS = ["The café", "Once upon a time there was", "漢字 and かな", "Déjà vu: the naïve coöperation of",
           "Tokens, bytes and characters: é is two bytes, 漢 is three. The café serves crème brûlée"]


def request_specs(n: int) -> list[dict]:
    """n different requests: greedy and sampled (seeded, top-k, top-p), prompts of 2 to 30 tokens (up to
    8 prefill chunks of 4), one with a stop string."""
    specs = []
    for i in range(n):
        kw = dict(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=6 + (i * 7) % 17)
        if i % 3 == 0:
            kw.update(temperature=0)
        else:
            kw.update(temperature=0.7 + 0.1 * (i % 4), seed=1000 + i, top_p=0.9 if i % 2 else 1.0,
                      extra_body={"top_k": 20} if i % 4 == 1 else None)
        if i == 0:
            kw["stop"] = ["Av"]        # its greedy text is 'nasAAvu...'

        specs.append(kw)
    return specs


def run_concurrently(fn, args: list) -> list:
    """fn(arg) on one thread each, released together; the results (or exceptions) in order."""
    out = [None] * len(args)
    gate = threading.Barrier(len(args))

    def work(k):
        gate.wait()
        try:
            out[k] = fn(args[k])
        except Exception as e:          # handed back to the test, which asserts on it
            out[k] = e
    ts = [threading.Thread(target=work, args=(k,)) for k in range(len(args))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    return out


def test_sixteen_concurrent_streams_each_equal_to_its_request_alone(fast):
    client = fast.client()
    specs = request_specs(16)
    alone = [completion(client, **kw)[:2] for kw in specs]          # one at a time, not streamed
    assert any(r == "stop" for _, r in alone) and any(r == "length" for _, r in alone)
    before = fast.health()[1]
    got = run_concurrently(lambda kw: completion(fast.client(), stream=True, **kw), specs)
    for k, (g, a) in enumerate(zip(got, alone)):
        assert not isinstance(g, Exception), f"stream {k}: {g!r}"
        assert g[:2] == a, f"stream {k}: {g[:2]} alone: {a}"
    st = fast.health()[1]
    assert st["finished"] - before["finished"] == 16 and st["running"] == 0
    assert st["peak_running"] > 1            # requests joined a running batch


# ---- disconnects free their slots ---------------------------------------------------------------
def test_a_client_that_disconnects_frees_its_slot(slow):
    client = slow.client()
    st0 = slow.wait_health(lambda s: s["running"] == 0 and s["queued"] == 0, "an idle server")
    # both slots taken by long streams (200 tokens at 20 ms a step: 4 s); one of them goes away
    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, stream=True)
    b = client.completions.create(model=MODEL, prompt="Once", max_tokens=200, temperature=0, stream=True)
    ia, ib = iter(a), iter(b)
    next(ia), next(ia), next(ib)
    assert slow.health()[1]["free_slots"] == 0
    a.close()
    st = slow.wait_health(lambda s: s["cancelled"] == st0["cancelled"] + 1, "the closed stream cancelled")
    assert st["running"] == 1 and st["free_slots"] == 1
    # the freed slot serves another request while b still runs
    text, reason, _ = completion(client, "The", max_tokens=3, temperature=0)
    assert reason == "length" and slow.health()[1]["running"] == 1
    # a client waiting for a whole completion that gives up (a timeout closes its connection)
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.5).completions.create(model=MODEL, prompt=PROMPT, max_tokens=200,
                                                            temperature=0)
    slow.wait_health(lambda s: s["cancelled"] == st0["cancelled"] + 2, "the abandoned request cancelled")
    b.close()
    st = slow.wait_health(lambda s: s["running"] == 0, "every slot free")
    assert st["free_slots"] == 2 and st["cancelled"] == st0["cancelled"] + 3 and st["failed"] == 0


# ---- errors: 4xx JSON, and the server keeps serving -----------------------------------------------
def error_of(status_body) -> dict:
    status, body = status_body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"], status=status)


BAD = [  # (what, body, status, param, code)
    ("unknown model", {"model": "gpt-4", "prompt": "a"}, 404, "model", "model_not_found"),
    ("no model", {"prompt": "a"}, 400, "model", None),
    ("max_tokens past the context", {"model": MODEL, "prompt": "a", "max_tokens": CONTEXT}, 400, "max_tokens",
     "context_length_exceeded"),
    ("a prompt of the whole context", {"model": MODEL, "prompt": [5] * CONTEXT, "max_tokens": 1}, 400, "prompt",
     "context_length_exceeded"),
    ("max_tokens 0", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens", None),
    ("temperature 3", {"model": MODEL, "prompt": "a", "temperature": 3}, 400, "temperature", None),
    ("top_p 0", {"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p", None),
    ("top_k -2", {"model": MODEL, "prompt": "a", "top_k": -2}, 400, "top_k", None),
    ("seed 1.5", {"model": MODEL, "prompt": "a", "seed": 1.5}, 400, "seed", None),
    ("five stops", {"model": MODEL, "prompt": "a", "stop": list("abcde")}, 400, "stop", None),
    ("n 2", {"model": MODEL, "prompt": "a", "n": 2}, 400, "n", "unsupported_parameter"),
    ("no prompt", {"model": MODEL}, 400, "prompt", None),
    ("an empty prompt", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("a token outside the vocabulary", {"model": MODEL, "prompt": [1, 100000]}, 400, "prompt", None),
    ("stream 'yes'", {"model": MODEL, "prompt": "a", "stream": "yes"}, 400, "stream", None),
]


@pytest.mark.parametrize("what,body,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_4xx_json_errors(fast, what, body, status, param, code):
    e = error_of(http(fast.url + "/v1/completions", body))
    assert (e["status"], e["param"], e["code"]) == (status, param, code), e
    assert e["type"] == "invalid_request_error" and e["message"]
    assert not e["message"].startswith(f"{param}: {param}:"), e          # the field named once


def test_malformed_bodies_paths_and_methods_and_the_server_keeps_serving(fast, checkpoint):
    for raw in (b"{bad json", b"[1, 2]", "\"é\"".encode("latin-1"), b""):
        e = error_of(http(fast.url + "/v1/completions", raw))
        assert (e["status"], e["code"]) == (400, "invalid_json"), (raw, e)
    e = error_of(http(fast.url + "/v1/chat/completions", {"model": MODEL, "messages": []}))
    assert (e["status"], e["param"]) == (400, "messages")
    e = error_of(http(fast.url + "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                      "content": 5}]}))
    assert (e["status"], e["param"]) == (400, "messages[0].content")
    assert error_of(http(fast.url + "/v1/nothing"))["status"] == 404
    assert error_of(http(fast.url + "/v1/completions", method="GET"))["status"] == 405
    # the official client: its typed errors, with OpenAI's body
    client = fast.client()
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="gpt-4", prompt="a")
    assert ei.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=CONTEXT)
    assert ei.value.code == "context_length_exceeded" and ei.value.param == "max_tokens"
    # and the server keeps serving
    assert completion(client, PROMPT, max_tokens=3, temperature=0)[1] == "length"
    st = fast.health()[1]
    assert st["failed"] == 0 and st["status"] == "ok"


# ---- overload: queued or 429 ---------------------------------------------------------------------
def test_overload_is_queued_or_refused_with_429(slow, fast):
    client = slow.client()
    slow.wait_health(lambda s: s["running"] == 0 and s["queued"] == 0, "an idle server")
    want = completion(fast.client(), PROMPT, max_tokens=40, temperature=0)[:2]     # (the same checkpoint)
    refused0 = slow.health()[1]["refused"]
    # 12 at once on 2 slots and a queue of 2: each takes 40 steps of >= 20 ms, so the first 4 are
    # accepted and the rest, arriving within that time, find the queue full
    clients = [slow.client() for _ in range(12)]
    got = run_concurrently(lambda c: completion(c, PROMPT, max_tokens=40, temperature=0)[:2], clients)
    ok = [g for g in got if not isinstance(g, Exception)]
    refused = [g for g in got if isinstance(g, openai.RateLimitError)]
    assert len(ok) + len(refused) == 12, [g for g in got if isinstance(g, Exception) and g not in refused]
    assert len(ok) >= 4 and refused, (len(ok), len(refused))
    assert all(g == want for g in ok)
    for r in refused:
        assert r.status_code == 429 and r.body["type"] == "rate_limit_error" and r.body["code"] == "queue_full"
    st = slow.wait_health(lambda s: s["running"] == 0, "an idle server")
    assert st["refused"] - refused0 == len(refused) and st["failed"] == 0
    assert completion(client, PROMPT, max_tokens=2, temperature=0)[1] == "length"


# ---- load: nothing lost ---------------------------------------------------------------------------
def test_load_from_64_clients_loses_nothing(fast, runslow):
    """200 requests (1000 with --runslow) from 64 clients, half of them streamed; each answer is its
    request's text alone."""
    n = 1000 if runslow else 200
    specs = [dict(kw, max_tokens=1 + kw["max_tokens"] % 4) for kw in request_specs(8)]
    client = fast.client()
    alone = [completion(client, **kw)[:2] for kw in specs]
    before = fast.health()[1]
    jobs: queue.Queue = queue.Queue()
    for i in range(n):
        jobs.put(i)
    results: dict[int, object] = {}

    def worker(_):
        c = fast.client()
        while True:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = completion(c, stream=bool(i % 2), **specs[i % len(specs)])[:2]
            except Exception as e:
                results[i] = e
    run_concurrently(worker, list(range(64)))
    assert len(results) == n
    wrong = {i: r for i, r in results.items() if r != alone[i % len(specs)]}
    assert not wrong, list(wrong.items())[:5]
    st = fast.health()[1]
    assert st["finished"] - before["finished"] == n and st["refused"] == before["refused"] and st["failed"] == 0


# ---- the README's snippet -------------------------------------------------------------------------
def test_readme_client_snippet_runs(fast):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Serving"):]
    code = re.search(r"```py\n(.*?)```", section, re.S).group(1)
    assert 'base_url="http://127.0.0.1:8000/v1"' in code and 'model="tiny"' in code
    code = code.replace("http://127.0.0.1:8000", fast.url)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "completion_tokens=8" in p.stdout


# ---- SIGTERM drains (last: it stops the slow server) --------------------------------------------
def test_sigterm_finishes_the_accepted_requests_and_exits_0(slow, fast):
    client = slow.client()
    slow.wait_health(lambda s: s["running"] == 0 and s["queued"] == 0, "an idle server")
    want = completion(fast.client(), PROMPT, max_tokens=50, temperature=0)[:2]     # (the same checkpoint)
    results: list = [None] * 3
    clients = [slow.client() for _ in range(3)]

    def stream(k):           # 50 steps of >= 20 ms each: the third waits in the queue for 1 s or more
        try:
            results[k] = completion(clients[k], PROMPT, stream=True, max_tokens=50, temperature=0)[:2]
        except Exception as e:
            results[k] = e
    ts = [threading.Thread(target=stream, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    slow.wait_health(lambda s: s["running"] == 2 and s["queued"] == 1, "2 running and 1 queued")
    slow.proc.send_signal(signal.SIGTERM)
    # while it drains, the server still listens: /health and a new request get 503, not a refused connection,
    # until the last accepted request is done (here: after the first two, the queued one runs its 50 steps of
    # >= 20 ms; a server that closed its socket at the signal fails the poll itself)
    slow.wait_health(lambda s: not s["accepting"] and s["running"] == 1 and s["queued"] == 0,
                     "draining, the queued request running")
    assert slow.health()[0] == 503
    with pytest.raises(openai.APIStatusError) as e:
        completion(client, PROMPT, max_tokens=1)
    assert e.value.status_code == 503 and "not taking new requests" in str(e.value), e.value
    rc = slow.proc.wait(120)
    for t in ts:
        t.join(60)
    assert rc == 0, "\n".join(slow.lines)
    assert results == [want] * 3, results
    drain = [ln for ln in slow.lines if "SIGTERM: draining" in ln]
    assert len(drain) == 1
    running, queued = map(int, re.search(r"\((\d+) running, (\d+) queued\)", drain[0]).groups())
    assert running + queued >= 1, drain          # the signal came while requests were in flight
    assert any(re.search(r"stopped: \d+ requests finished", ln) for ln in slow.lines), slow.lines
    with pytest.raises(openai.APIConnectionError):        # nothing listens any more
        completion(client, PROMPT, max_tokens=1)


# ---- the command line's errors: one line, nothing served -------------------------------------------
def serve_cli(capsys, *argv):
    from megatape import cli
    rc = cli.main(["serve", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, err.strip().splitlines()


def test_serve_cli_errors_are_one_line(ckpt, capsys, tmp_path):
    import socket

    from megatape.serve import batched_kernel_available
    rc, err = serve_cli(capsys, "--model", tmp_path / "nothing")
    assert rc == 2 and len(err) == 1 and err[0].startswith("megatape serve: error: argument --model:"), err
    rc, err = serve_cli(capsys, "--model", ckpt, "--max-seq", CONTEXT + 1)
    assert rc == 2 and err[-1].startswith("megatape serve: error: argument --max-seq:") and "256" in err[-1], err
    rc, err = serve_cli(capsys, "--model", ckpt, "--max-batch", 0)
    assert rc == 2 and "argument --max-batch" in err[-1], err
    if not batched_kernel_available():
        rc, err = serve_cli(capsys, "--model", ckpt, "--backend", "kernel")
        assert rc == 2 and err[-1].startswith("megatape serve: error: argument --backend: kernel needs"), err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        rc, err = serve_cli(capsys, "--model", ckpt, "--backend", "ref", "--port", taken.getsockname()[1])
    assert rc == 1 and err[-1].startswith("megatape serve: error: argument --port: cannot listen on 127.0.0.1:"), err


# ---- the engine and the app without a server -----------------------------------------------------
def test_host_sampling():
    g = torch.Generator().manual_seed(0)
    tie = torch.tensor([0.0, 2.0, 2.0, 1.0])
    assert sample_token(tie, Sampling(temperature=0), None) == 1          # greedy: ties to the lowest index
    lg = torch.randn(300, generator=g)
    best = int(torch.argmax(lg))
    for s in (Sampling(temperature=1.5, top_k=1, seed=1), Sampling(temperature=1.0, top_p=1e-6, seed=2)):
        assert {sample_token(lg, s, s.generator()) for _ in range(20)} == {best}
    # top-k keeps the k largest; top-p the fewest reaching p (probabilities 0.5, 0.3, 0.2: p 0.6 keeps two)
    three = torch.tensor([0.5, 0.3, 0.2]).log()
    s = Sampling(temperature=1.0, top_p=0.6, seed=3)
    gen = s.generator()
    assert {sample_token(three, s, gen) for _ in range(200)} == {0, 1}
    s = Sampling(temperature=1.0, top_k=2, seed=4)
    gen = s.generator()
    assert {sample_token(three, s, gen) for _ in range(200)} == {0, 1}
    # the draw follows softmax(logits / T): P(1) = 3/4 for logits (0, log 3) at T 1, and 3^(1/2) / (1 + 3^(1/2))
    # at T 2; 4000 seeded draws (deterministic) within 5 standard deviations
    two = torch.tensor([0.0, float(torch.tensor(3.0).log())])
    for T, p in ((1.0, 0.75), (2.0, 3 ** 0.5 / (1 + 3 ** 0.5))):
        hits = sum(sample_token(two, Sampling(temperature=T, seed=k), Sampling(temperature=T, seed=k).generator())
                   for k in range(4000))
        assert abs(hits / 4000 - p) < 5 * (p * (1 - p) / 4000) ** 0.5, (T, hits)
    # a seed repeats, another seed differs
    s1, s2 = Sampling(temperature=1.0, seed=7), Sampling(temperature=1.0, seed=8)
    draws = [[sample_token(lg, s, gen) for _ in range(30)] for s, gen in
             ((s1, s1.generator()), (s1, s1.generator()), (s2, s2.generator()))]
    assert draws[0] == draws[1] != draws[2]
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1)


class Recording:
    """A backend over another that records its calls: ('prefill', slot, start, n) / ('decode', slots, pos)."""

    def __init__(self, inner, fail_at=None):
        self.inner, self.calls, self.fail_at = inner, [], fail_at
        self.name, self.max_batch, self.max_seq, self.vocab = "rec", inner.max_batch, inner.max_seq, inner.vocab

    def prefill(self, tokens, slot, start_pos, logits=True):
        self.calls.append(("prefill", slot, start_pos, len(tokens), logits))
        return self.inner.prefill(tokens, slot, start_pos, logits=logits)

    def decode(self, tokens, slots, pos):
        self.calls.append(("decode", tuple(slots), tuple(pos)))
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("a device error")
        return self.inner.decode(tokens, slots, pos)

    def close(self):
        pass


def run_engine(engine, reqs) -> list[Request]:
    done = threading.Semaphore(0)
    for r in reqs:
        r.sink = lambda ev: done.release() if ev.kind != "text" else None
    for r in reqs:
        engine.submit(r)
    for _ in reqs:
        assert done.acquire(timeout=120)
    return reqs


@pytest.fixture(scope="module")
def weights(checkpoint):
    return checkpoint.load_weights("cpu")


def test_engine_chunks_prefill_one_chunk_a_step_beside_the_decodes(checkpoint, weights):
    tok = checkpoint.tokenizer

    def make():
        return [Request(checkpoint.encode(p), 8, Sampling(temperature=0.0 if i % 2 == 0 else 0.9, seed=i))
                for i, p in enumerate(PROMPTS)]
    one = Engine(RefBackend(weights, checkpoint.cfg, 4, 64), tok, checkpoint.eos_token_ids, prefill_chunk=128).start()
    want = [(r.text, r.tokens) for r in run_engine(one, make())]
    one.shutdown()
    rec = Recording(RefBackend(weights, checkpoint.cfg, 2, 64))
    eng = Engine(rec, tok, checkpoint.eos_token_ids, prefill_chunk=3)
    step = eng._step

    def marked(prefill, decode):           # the step boundaries in the backend's call list
        rec.calls.append(("step",))
        step(prefill, decode)
    eng._step = marked
    got = run_engine(eng.start(), make())  # 5 requests, 2 slots: they queue, join and leave
    assert eng.shutdown() and [(r.text, r.tokens) for r in got] == want
    # a step: at most one prefill chunk, then at most one decode; some steps have both (interleaved)
    steps, cur = [], None
    for c in rec.calls:
        if c[0] == "step":
            cur = []
            steps.append(cur)
        else:
            cur.append(c[0])
    assert all(k in (["prefill"], ["decode"], ["prefill", "decode"]) for k in steps), steps
    assert ["prefill", "decode"] in steps
    rec.calls = [c for c in rec.calls if c[0] != "step"]
    for r in got:
        chunks = [(c[2], c[3]) for c in rec.calls if c[0] == "prefill" and c[1] == r.slot and c[2] < len(r.prompt_ids)]
        assert all(n <= 3 for _, n in chunks)
    assert max(len(c[1]) for c in rec.calls if c[0] == "decode") == 2
    for c in rec.calls:
        if c[0] == "decode":
            assert len(set(c[1])) == len(c[1])                  # one row a slot
    st = eng.stats()
    assert st["finished"] == 5 and st["free_slots"] == 2 and st["peak_running"] == 2
    # a prompt's chunks before its last ask for no logits (the kernel skips its LM head), its last one does
    rec.calls = []
    e1 = Engine(rec, tok, checkpoint.eos_token_ids, prefill_chunk=1).start()
    (r,) = run_engine(e1, [Request(checkpoint.encode(PROMPTS[0]), 2, Sampling(temperature=0))])
    e1.shutdown()
    pre = [(c[2], c[3], c[4]) for c in rec.calls if c[0] == "prefill"]
    n = len(r.prompt_ids)
    assert n > 1 and [s for s, _, _ in pre] == list(range(n))
    assert [lg for _, _, lg in pre] == [s + k == n for s, k, _ in pre] and r.tokens == want[0][1][:2]


class DeviceLogits(torch.Tensor):
    """Logits that must stay where the backend made them: ``.cpu()`` counts (the engine may copy only the
    rows it samples on the host)."""

    copies = 0

    def cpu(self, *a, **k):
        DeviceLogits.copies += 1
        return super().cpu(*a, **k)


class OnDevice(Recording):
    def prefill(self, tokens, slot, start_pos, logits=True):
        out = super().prefill(tokens, slot, start_pos, logits=logits)
        return None if out is None else out.as_subclass(DeviceLogits)

    def decode(self, tokens, slots, pos):
        return super().decode(tokens, slots, pos).as_subclass(DeviceLogits)


def test_engine_takes_greedy_tokens_where_the_logits_are(checkpoint, weights):
    """Greedy rows' tokens come from one batched argmax over the backend's logits (no copy of them to the
    host); sampled rows' logits alone come over, one copy a token; the texts are those of the plain run."""
    tok = checkpoint.tokenizer

    def make():
        return [Request(checkpoint.encode(p), 8, Sampling(temperature=0.0 if i % 2 == 0 else 0.9, seed=i))
                for i, p in enumerate(PROMPTS)]
    plain = Engine(RefBackend(weights, checkpoint.cfg, 4, 64), tok, checkpoint.eos_token_ids).start()
    want = [(r.text, r.tokens) for r in run_engine(plain, make())]
    plain.shutdown()
    DeviceLogits.copies = 0
    eng = Engine(OnDevice(RefBackend(weights, checkpoint.cfg, 4, 64)), tok, checkpoint.eos_token_ids).start()
    got = run_engine(eng, make())
    eng.shutdown()
    assert [(r.text, r.tokens) for r in got] == want
    assert DeviceLogits.copies == sum(len(r.tokens) for r in got if r.sampling.temperature > 0)


def test_engine_eos_ends_a_request_unprinted(checkpoint, weights):
    tok = checkpoint.tokenizer
    ids = checkpoint.encode(PROMPT)
    eng = Engine(RefBackend(weights, checkpoint.cfg, 2, 64), tok, checkpoint.eos_token_ids).start()
    (r,) = run_engine(eng, [Request(ids, 6, Sampling(temperature=0))])
    eng.shutdown()
    assert r.finish_reason == "length" and r.text == tok.decode(r.tokens, skip_special_tokens=True)
    eos = r.tokens[2]                      # the third greedy token as the EOS: two tokens of text, three counted
    assert eos not in r.tokens[:2]
    eng = Engine(RefBackend(weights, checkpoint.cfg, 2, 64), tok, [eos]).start()
    events = []
    done = threading.Event()
    r2 = Request(ids, 6, Sampling(temperature=0))
    r2.sink = lambda ev: (events.append(ev), ev.kind != "text" and done.set())
    eng.submit(r2)
    assert done.wait(60)
    eng.shutdown()
    assert r2.tokens == r.tokens[:3] and r2.finish_reason == "stop"
    assert "".join(e.text for e in events if e.kind == "text") == r2.text == tok.decode(r.tokens[:2],
                                                                                       skip_special_tokens=True)
    assert (events[-1].kind, events[-1].finish_reason, events[-1].completion_tokens) == ("done", "stop", 3)


def test_engine_a_failing_step_is_an_error_event_and_the_engine_goes_on(checkpoint, weights):
    rec = Recording(RefBackend(weights, checkpoint.cfg, 2, 64), fail_at=2)
    logs = []
    eng = Engine(rec, checkpoint.tokenizer, checkpoint.eos_token_ids, log=logs.append).start()
    events = []
    r = Request(checkpoint.encode(PROMPT), 5, Sampling(temperature=0))
    done = threading.Event()
    r.sink = lambda ev: (events.append(ev), ev.kind != "text" and done.set())
    eng.submit(r)
    assert done.wait(60)
    assert events[-1].kind == "error" and "a device error" in events[-1].text and "a device error" in logs[0]
    (r2,) = run_engine(eng, [Request(checkpoint.encode(PROMPT), 5, Sampling(temperature=0))])
    assert r2.finish_reason == "length" and len(r2.tokens) == 5
    st = eng.stats()
    assert st["failed"] == 1 and st["finished"] == 1 and st["free_slots"] == 2
    eng.shutdown()
    with pytest.raises(ValueError, match="max_tokens: the context is 64"):
        eng.check(Request([1] * 60, 5))


def test_engine_counts_a_request_before_its_last_event(checkpoint, weights):
    """The engine's stats (/health) count a request finished, or failed, and free its slot before the client
    gets its last event: a client that asks /health after its stream ended sees it (the other order raced)."""
    seen = []

    def run(eng, n_tokens):
        r = Request(checkpoint.encode(PROMPT), n_tokens, Sampling(temperature=0))
        done = threading.Event()
        r.sink = lambda ev: (ev.kind != "text" and (seen.append((ev.kind, eng.stats())), done.set()))
        eng.submit(r)
        assert done.wait(60)

    eng = Engine(RefBackend(weights, checkpoint.cfg, 2, 64), checkpoint.tokenizer, checkpoint.eos_token_ids).start()
    run(eng, 3)
    eng.shutdown()
    rec = Recording(RefBackend(weights, checkpoint.cfg, 2, 64), fail_at=2)
    eng = Engine(rec, checkpoint.tokenizer, checkpoint.eos_token_ids, log=lambda m: None).start()
    run(eng, 5)
    eng.shutdown()
    (k1, s1), (k2, s2) = seen
    assert (k1, s1["finished"], s1["running"], s1["free_slots"]) == ("done", 1, 0, 2)
    assert (k2, s2["failed"], s2["running"], s2["free_slots"]) == ("error", 1, 0, 2)


def test_app_answers_503_while_draining(checkpoint, weights):
    from starlette.testclient import TestClient

    from megatape.serve.app import create_app
    eng = Engine(RefBackend(weights, checkpoint.cfg, 2, 64), checkpoint.tokenizer, checkpoint.eos_token_ids)
    app = create_app(eng, model_id=MODEL, encode=checkpoint.encode, chat=None, context=64)
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        e = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "a"}]})
        assert e.status_code == 400 and "no chat template" in e.json()["error"]["message"]
        eng.drain()
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "draining"
