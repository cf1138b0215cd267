"""The HTTP side of ``megatape serve``: a FastAPI app with the OpenAI API's shapes over an :class:`Engine`.

    app = create_app(engine, model_id="tiny", encode=checkpoint.encode, chat=..., context=engine.backend.max_seq)

Endpoints: ``POST /v1/completions`` (``prompt``: a string, a list of one string, or a list of token
ids), ``POST /v1/chat/completions`` (``messages`` through the tokenizer's chat template), both with
``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream`` (server-sent events, ending
``data: [DONE]``; ``stream_options.include_usage``) and ``top_k`` (an extension); ``GET /v1/models``;
``GET /health`` (200 while serving, 503 while draining; the engine's counts).

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: 400 a malformed body or a
bad parameter (a prompt and max_tokens past the context: code ``context_length_exceeded``), 404 an
unknown model or path, 405, 422, 429 when the queue is full, 503 while the server drains. Parameters
that would change what is generated and are not implemented (``n`` > 1, ``logprobs``, ``echo``,
penalties, ``logit_bias``, tools, ...) are a 400 naming the parameter; others are ignored.

A client that goes away (a closed stream, or a dropped connection while waiting for a whole
completion) cancels its request: its slot is free at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Callable

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Draining, Engine, Event, QueueFull, Request, Sampling

#: parameters accepted only at these values (None: absent), with what they would ask for
UNSUPPORTED = {
    "n": ((None, 1), "n > 1 (one choice per request)"),
    "best_of": ((None, 1), "best_of > 1"),
    "echo": ((None, False), "echo"),
    "logprobs": ((None, False, 0), "logprobs"),
    "top_logprobs": ((None, 0), "top_logprobs"),
    "suffix": ((None,), "suffix"),
    "frequency_penalty": ((None, 0, 0.0), "frequency_penalty"),
    "presence_penalty": ((None, 0, 0.0), "presence_penalty"),
    "logit_bias": ((None, {}), "logit_bias"),
    "tools": ((None, []), "tools"),
    "functions": ((None, []), "functions"),
}
MAX_STOP = 4


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_response(status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}},
                        status_code=status)


# ---- request parsing ----------------------------------------------------------------------------
def _bad(param: str, expected: str, got) -> ApiError:
    return ApiError(400, f"{param}: expected {expected}, got {json.dumps(got)[:80]}", param=param)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not ((v > lo if lo_open else v >= lo) and v <= hi):
        raise _bad(name, f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", v)
    return float(v)


def _integer(body: dict, name: str, default, lo: int, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        raise _bad(name, f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""), v)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOP} of them", v)
    return stops


def _common(body: dict, model_id: str) -> dict:
    """What both endpoints take: model (checked), sampling, stop, stream."""
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", "a model id (GET /v1/models)", model)
    if model != model_id:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{model_id}`", param="model",
                       code="model_not_found")
    for name, (allowed, what) in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise ApiError(400, f"{name}: {what} is not supported by this server", param=name,
                           code="unsupported_parameter")
    top_k = body.get("top_k")
    if top_k == -1:                  # vLLM's "off"
        top_k = 0
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise _bad("top_k", "an integer >= 0 (0 or -1: off)", top_k)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad("seed", "an integer", seed)
    sampling = Sampling(temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_k=top_k or 0,
                        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), seed=seed)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", "true or false", stream)
    so = body.get("stream_options") or {}
    if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
        raise _bad("stream_options", 'an object {"include_usage": true|false}', so)
    return dict(sampling=sampling, stop=_stop(body), stream=stream, include_usage=bool(so.get("include_usage")))


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _bad(where, "a string or a list of text parts", content)


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "a non-empty list of messages", msgs)
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", 'an object with a "role" and a "content"', m)
        out.append({"role": m["role"], "content": _text_of(m.get("content"), f"messages[{i}].content")})
    return out


# ---- responses -----------------------------------------------------------------------------------
def _usage(ev: Event) -> dict:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that always closes its body iterator (whose ``finally`` cancels the request),
    however the response ends (the client gone, the task cancelled)."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


async def _wait_disconnect(http: HttpRequest) -> None:
    """Returns when the client has gone (the body has been read: the next message is the disconnect)."""
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            return


# ---- the app -------------------------------------------------------------------------------------
def create_app(engine: Engine, *, model_id: str, encode: Callable[[str], list[int]],
               chat: Callable[[list[dict]], list[int]] | None, context: int, created: int | None = None,
               log: Callable[[str], None] | None = None) -> FastAPI:
    """The app over ``engine`` (started and shut down with the app's lifespan). ``encode(text)`` and
    ``chat(messages)`` give a prompt's token ids (ValueError: a 400), called under the engine's
    tokenizer lock; ``chat`` None: no chat template (chat requests are a 400); ``context``: the
    positions a request may use (prompt + max_tokens)."""
    created = int(time.time()) if created is None else created
    log = log or engine.log

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="megatape serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return error_response(422, f"invalid request: {e.errors()}")

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log(f"megatape serve: {request.method} {request.url.path}: {type(e).__name__}: {e}")
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.get("/health")
    async def health():
        st = engine.stats()
        return JSONResponse({"status": "ok" if st["accepting"] else "draining", **st},
                            status_code=200 if st["accepting"] else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "megatape", "max_model_len": context}]}

    async def _body(http: HttpRequest) -> dict:
        raw = await http.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json")
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                           code="invalid_json")
        return body

    def _tokens(fn, arg, param: str) -> list[int]:
        try:
            with engine.tokenizer_lock:
                return fn(arg)
        except (ValueError, TypeError) as e:
            msg = str(e)       # (the tokenizer's errors may name the field already: "prompt: no tokens ...")
            raise ApiError(400, msg if msg.startswith(f"{param}:") else f"{param}: {msg}", param=param)

    def _check_context(ids: list[int], max_tokens: int, param: str, max_param: str) -> None:
        P = len(ids)
        if P >= context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens; the prompt has {P}: "
                           "no room for a completion", param=param, code="context_length_exceeded")
        if P + max_tokens > context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                           f"{P + max_tokens} tokens ({P} in the prompt, {max_tokens} in the completion). "
                           f"Please reduce the prompt or {max_param}.", param=max_param,
                           code="context_length_exceeded")

    def _submit(req: Request) -> None:
        try:
            engine.submit(req)
        except QueueFull as e:
            raise ApiError(429, f"{e}: try again later", type="rate_limit_error", code="queue_full")
        except Draining as e:
            raise ApiError(503, f"{e}: not taking new requests", type="service_unavailable", code="draining")
        except ValueError as e:
            raise ApiError(400, str(e), param=str(e).split(":")[0], code="context_length_exceeded"
                           if str(e).startswith("max_tokens") else None)

    def _queue_sink():
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(q.put_nowait, ev)
        return q, sink

    async def _run(http: HttpRequest, req: Request, q: asyncio.Queue, opts: dict, chunk, whole):
        """Submit ``req`` and answer: an SSE stream of ``chunk(text, finish_reason)`` objects, or
        ``whole(text, done_event)``."""
        _submit(req)
        rid = req.id

        if opts["stream"]:
            async def events():
                done = False
                try:
                    first = chunk(None, None)
                    if first is not None:
                        yield _sse(first)
                    while True:
                        ev = await q.get()
                        if ev.kind == "text":
                            yield _sse(chunk(ev.text, None))
                        elif ev.kind == "done":
                            done = True
                            yield _sse(chunk("", ev.finish_reason))
                            if opts["include_usage"]:
                                yield _sse({**chunk("", None), "choices": [], "usage": _usage(ev)})
                            yield "data: [DONE]\n\n"
                            return
                        else:
                            done = True
                            yield _sse({"error": {"message": ev.text, "type": "server_error", "param": None,
                                                  "code": None}})
                            return
                finally:
                    if not done:
                        engine.cancel(req)
            return _ClosingStream(events(), media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Request-Id": str(rid)})

        async def collect():
            parts = []
            while True:
                ev = await q.get()
                if ev.kind == "text":
                    parts.append(ev.text)
                else:
                    return "".join(parts), ev
        waiter = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_wait_disconnect(http))
        try:
            await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiter.done():
                waiter.cancel()
                engine.cancel(req)
            gone.cancel()
        if not waiter.done() or waiter.cancelled():
            return JSONResponse({}, status_code=499)      # nobody is listening
        text, ev = waiter.result()
        if ev.kind == "error":
            raise ApiError(500, ev.text, type="server_error")
        return JSONResponse(whole(text, ev), headers={"X-Request-Id": str(rid)})

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body = await _body(http)
        opts = _common(body, model_id)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = _tokens(encode, prompt, "prompt")
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise _bad("prompt", "a string, a list of one string or a non-empty list of token ids", prompt)
        max_tokens = _integer(body, "max_tokens", 16, 1)
        _check_context(ids, max_tokens, "prompt", "max_tokens")
        cid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": now, "model": model_id}
        q, sink = _queue_sink()
        req = Request(ids, max_tokens, opts["sampling"], opts["stop"], sink)

        def chunk(text, reason):
            if text is None:
                return None
            return {**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

        def whole(text, ev):
            return {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": ev.finish_reason}], "usage": _usage(ev)}
        return await _run(http, req, q, opts, chunk, whole)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        body = await _body(http)
        opts = _common(body, model_id)
        msgs = _messages(body)
        if chat is None:
            raise ApiError(400, "messages: the model's tokenizer has no chat template; use /v1/completions",
                           param="messages")
        ids = _tokens(chat, msgs, "messages")
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _integer({name: mt}, name, max(1, context - len(ids)), 1)
        _check_context(ids, max_tokens, "messages", name)
        cid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": model_id}
        q, sink = _queue_sink()
        req = Request(ids, max_tokens, opts["sampling"], opts["stop"], sink)

        def chunk(text, reason):
            delta = {"role": "assistant", "content": ""} if text is None else \
                ({"content": text} if text else {})
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        def whole(text, ev):
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                 "finish_reason": ev.finish_reason}], "usage": _usage(ev)}
        return await _run(http, req, q, opts, chunk, whole)

    return app
