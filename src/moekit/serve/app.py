"""The HTTP app: OpenAI's completion and chat routes, /v1/models, /health and /metrics.

The model loads on the engine thread after the server is up (/health answers 503 until then), and
that thread then runs the scheduler. A route validates its body, submits a scheduler Request whose
callbacks post to an asyncio queue, and turns what arrives into a JSON reply or server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moekit.engine.sampling import SamplingParams
from moekit.errors import MoekitError
from moekit.serve.errors import ApiError, bad_request, error_response
from moekit.serve.metrics import ServerMetrics
from moekit.serve.protocol import ChatRequest, CompletionRequest, Sampled, parse_body
from moekit.engine.router_health import watch_routers
from moekit.serve.canary import HEADER as CANARY_HEADER, on_canary
from moekit.serve.health import EntropyCollector, JitterMetrics
from moekit.serve.sla import GoodputCollector, TierControl
from moekit.serve.text import StopText

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


@dataclass
class ServeConfig:
    checkpoint: Path
    model_name: str
    dtype: str = "float32"
    device: str = "cpu"
    max_batch: int = 16
    max_context: Optional[int] = None  # slots per row; default the model's context
    queue_limit: int = 256  # waiting requests per tier before 429
    max_body_bytes: int = 1 << 20
    offload: Optional[object] = None  # moekit.offload.options.OffloadOptions
    threads: Optional[int] = None
    admin_token: Optional[str] = None  # enables the hot-swap routes (moekit.serve.admin)
    verify: bool = True  # check the weights against moekit-experts.json as they load (--no-verify: False)
    compile: bool = False  # decode steps as one compiled graph (--compile; moekit.model.compiled_step)
    weights: str = "dtype"  # --weights: dtype, int8 or int8-experts (moekit.engine.loader.WEIGHTS)
    tiers: dict = field(default_factory=dict)  # --tier: name -> moekit.serve.sla.TierTargets
    sla_action: str = "reject"  # --sla-action: what a request over its tier's TTFT target gets


@dataclass
class ServerState:
    config: ServeConfig
    engine: Optional[object] = None
    scheduler: Optional[object] = None
    template: Optional[object] = None
    error: Optional[str] = None
    on_fatal: Optional[Callable[[str], None]] = None  # the CLI stops the server on a load failure
    ready: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: Optional[threading.Thread] = None
    metrics: Optional[ServerMetrics] = None
    tiers: Optional[TierControl] = None
    jitter: Optional[JitterMetrics] = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._engine_thread, name="moekit-engine", daemon=True)
        self.thread.start()

    def _engine_thread(self) -> None:
        try:
            self._load()
        except Exception as err:  # noqa: BLE001 - reported once, then the server stops
            self.error = str(err).splitlines()[0] if str(err) else type(err).__name__
            if self.on_fatal is not None:
                self.on_fatal(self.error)
            return
        self.ready.set()
        self.scheduler.run(self.stop)

    def _load(self) -> None:
        import torch

        from moekit.engine.loader import load_engine
        from moekit.engine.scheduler import Scheduler
        from moekit.serve.chat import load_chat_template

        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        engine = load_engine(cfg.checkpoint, dtype=cfg.dtype, device=cfg.device, offload=cfg.offload, verify=cfg.verify,
                             compile=cfg.compile, weights=cfg.weights)
        if engine.decoder.compiled is not None:
            engine.decoder.compiled.warm_up()  # compiled before /health says ready, not on a request
        else:
            watch_routers(engine.decoder)  # routing entropy for /metrics (router health)
        self.template = load_chat_template(Path(cfg.checkpoint))
        self.scheduler = Scheduler(
            engine.decoder,
            max_batch=cfg.max_batch,
            max_len=cfg.max_context,
            bytes_per_param=engine.bytes_per_param,
            expert_bytes=engine.expert_bytes,  # int8 / packed / paged experts at their real bytes
            dense_saving=engine.dense_saving,  # and int8 projections (--weights int8)
            queue_limit=cfg.queue_limit,
            store=engine.store,
            on_step=self._step_done,
        )
        self.engine = engine

    def _step_done(self, step) -> None:
        if step.batch:
            self.metrics.batch.observe(step.batch)
            self.tiers.admission.step_done(step.seconds)

    def shutdown(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        if self.scheduler is not None:
            self.scheduler.abort_all("the server is shutting down")
        if self.engine is not None:
            self.engine.close()


def create_app(config: ServeConfig, on_ready: Optional[Callable[[ServerState], None]] = None) -> FastAPI:
    state = ServerState(config=config, tiers=TierControl.build(config.tiers, config.sla_action))
    state.metrics = ServerMetrics(state)
    state.metrics.registry.register(GoodputCollector(state.tiers.goodput))
    state.metrics.registry.register(EntropyCollector(state))
    state.jitter = JitterMetrics(state.metrics.registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        if on_ready is not None:
            asyncio.get_running_loop().run_in_executor(None, _announce, state, on_ready)
        yield
        state.shutdown()

    app = FastAPI(title="moekit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.moekit = state

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err: StarletteHTTPException):
        return error_response(err.status_code, str(err.detail), code=None)

    @app.exception_handler(Exception)
    async def _unexpected(request, err: Exception):
        return error_response(500, f"internal error: {type(err).__name__}: {err}", code="internal_error")

    from moekit.serve.admin import register_admin_routes

    register_admin_routes(app, state)

    @app.get("/health")
    async def health():
        if state.error is not None:
            return error_response(503, f"the model failed to load: {state.error}")
        if not state.ready.is_set():
            return error_response(503, "the model is loading")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models():
        card = {"id": config.model_name, "object": "model", "created": int(time.time()), "owned_by": "moekit"}
        if state.scheduler is not None:
            card["max_model_len"] = state.scheduler.max_len
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body = parse_body(await _read_body(http, config.max_body_bytes), CompletionRequest)
        engine = _ready_engine(state, body)
        prompt = body.prompt
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise bad_request("this model has no tokenizer.json: send the prompt as a list of token ids", "prompt")
            ids = engine.encode(prompt)
        else:
            ids = list(prompt)
        return await _generate(http, state, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        body = parse_body(await _read_body(http, config.max_body_bytes), ChatRequest)
        engine = _ready_engine(state, body)
        if engine.tokenizer is None:
            raise bad_request("this model has no tokenizer.json: chat needs text; use /v1/completions with token ids")
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        try:
            text = state.template.render(messages)
        except MoekitError as err:
            raise bad_request(str(err), "messages") from None
        ids = list(engine.tokenizer.encode(text, add_special_tokens=False).ids)
        return await _generate(http, state, body, ids, body.output_limit, chat=True)

    return app


def _announce(state: ServerState, on_ready) -> None:
    while not state.ready.wait(0.2):
        if state.error is not None or state.stop.is_set():
            return
    on_ready(state)


async def _read_body(http: HttpRequest, limit: int) -> bytes:
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {declared} bytes; the limit is {limit}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body is over the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _ready_engine(state: ServerState, body: Sampled):
    if state.error is not None:
        raise ApiError(503, f"the model failed to load: {state.error}")
    if not state.ready.is_set():
        raise ApiError(503, "the model is loading; retry when /health answers 200")
    if body.model is not None and body.model != state.config.model_name:
        raise ApiError(
            404, f"the model {body.model!r} does not exist; this server serves {state.config.model_name!r}", "model", "model_not_found"
        )
    return state.engine


def _request_for(state: ServerState, body: Sampled, ids: list[int], max_tokens: Optional[int]):
    """The scheduler Request for a validated body, or a 400 naming the field at fault."""
    from moekit.engine.scheduler import Request

    scheduler, engine = state.scheduler, state.engine
    vocab = engine.spec.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
    room = scheduler.max_len - len(ids)
    if room <= 0:
        raise bad_request(f"the prompt has {len(ids)} tokens; the context holds {scheduler.max_len}", "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(DEFAULT_COMPLETION_TOKENS, room) if isinstance(body, CompletionRequest) else room
    if max_tokens <= 0:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens > room:
        raise bad_request(
            f"max_tokens {max_tokens} + the prompt's {len(ids)} tokens exceed the context of {scheduler.max_len}",
            "max_tokens",
            "context_length_exceeded",
        )
    tier, top_k, routing = "S", None, None
    if body.moe is not None:
        tier = body.moe.tier or "S"
        top_k = body.moe.top_k
        if top_k is not None and scheduler.model_k and top_k > scheduler.model_k:
            raise bad_request(f"moe.top_k must be between 1 and the model's {scheduler.model_k}, got {top_k}", "moe.top_k")
        routing = _request_policy(scheduler, body.moe)
    sampling = SamplingParams(
        temperature=body.temperature,
        top_k=body.top_k if body.top_k > 0 else None,
        top_p=body.top_p,
        seed=body.seed,
    )
    return Request(
        prompt=ids,
        max_new_tokens=max_tokens,
        sampling=sampling,
        stop_ids=() if body.ignore_eos else tuple(engine.eos_ids),
        tier=tier,
        top_k=top_k,
        routing=routing,
    )


def _request_policy(scheduler, moe):
    """moe.routing parsed against the model's K, or a 400 naming it."""
    if moe.routing is None:
        return None
    from moekit.model.routing import parse_policy

    if moe.top_k is not None:
        raise bad_request("moe.routing and moe.top_k both set the experts per token: send one", "moe.routing")
    if not scheduler.model_k:
        raise bad_request("this model has no MoE layers, so there is no routing to choose", "moe.routing")
    try:
        return parse_policy(moe.routing, scheduler.model_k)
    except MoekitError as err:
        raise bad_request(f"moe.routing: {err}", "moe.routing") from None


def _place(state: ServerState, request) -> None:
    """Admission under the tiers' TTFT targets (429, or a lower tier), then the tier's own policy
    for a request that chose none."""
    decision = state.tiers.place(request.tier, state.scheduler)
    if decision.tier is None:
        raise ApiError(429, decision.reason, code="rate_limit_exceeded")
    request.tier = decision.tier
    policy = state.tiers.routing(request.tier)
    if request.routing is None and request.top_k is None and policy is not None and state.scheduler.model_k:
        from moekit.model.routing import parse_policy

        request.routing = parse_policy(policy, state.scheduler.model_k)  # checked when the server started


@dataclass
class _Exchange:
    """One request's traffic between the engine thread and the event loop."""

    queue: asyncio.Queue
    token_times: list[float] = field(default_factory=list)
    abandoned: Optional[Callable] = None  # set when the client left: where the outcome goes then

    def deliver_finish(self, outcome) -> None:
        """On the event loop: the outcome goes to the reply, or straight to the books if nobody waits."""
        if self.abandoned is not None:
            self.abandoned(outcome)
        else:
            self.queue.put_nowait(("finish", outcome))


async def _generate(http: HttpRequest, state: ServerState, body: Sampled, ids: list[int], max_tokens, chat: bool):
    from moekit.engine.scheduler import QueueFull

    request = _request_for(state, body, ids, max_tokens)
    loop = asyncio.get_running_loop()
    exchange = _Exchange(queue=asyncio.Queue())

    def post(callback, *args) -> None:
        # The engine thread must never fail because the event loop is gone (a shutdown past its grace).
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass

    def on_token(token: int) -> None:
        exchange.token_times.append(time.perf_counter())
        post(exchange.queue.put_nowait, ("token", token))

    def on_finish(outcome) -> None:
        post(exchange.deliver_finish, outcome)

    request.on_token, request.on_finish = on_token, on_finish
    _place(state, request)
    request.canary = on_canary(state.scheduler.canary, http.headers.get(CANARY_HEADER))
    try:
        state.scheduler.submit(request)
    except QueueFull as err:
        raise ApiError(429, str(err), code="rate_limit_exceeded") from None
    except MoekitError as err:
        raise bad_request(str(err)) from None
    reply = _Reply(state, body, request, ids, chat, exchange)
    if body.stream:
        first = await exchange.queue.get()  # a request that fails before its first token answers 500
        if first[0] == "finish" and first[1].finish_reason == "error":
            reply.finish(first[1])
            raise ApiError(500, f"generation failed: {first[1].error}", code="engine_error")
        return StreamingResponse(reply.events(first), media_type="text/event-stream", headers={"cache-control": "no-cache"})
    return await reply.whole(http)


class _Reply:
    """Builds a response from one request's tokens: its text (cut at stop strings), ids and usage."""

    def __init__(self, state: ServerState, body: Sampled, request, ids: list[int], chat: bool, exchange: _Exchange):
        self.state, self.body, self.request, self.prompt, self.chat = state, body, request, ids, chat
        self.exchange = exchange
        self.text = StopText(state.engine.tokenizer, body.stops)
        self.token_ids: list[int] = []
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.with_ids = body.return_token_ids or state.engine.tokenizer is None
        self.outcome = None

    def _push(self, token: int) -> str:
        self.token_ids.append(token)
        piece = self.text.push(token)
        if self.text.stopped and not self.request.cancelled:
            self.state.scheduler.cancel(self.request)  # a stop string: the row leaves at the next step
        return piece

    def finish(self, outcome) -> str:
        """The request ended: record it in the metrics, return the text still held back."""
        self.outcome = outcome
        rest = self.text.flush()  # first: a stop string in the held-back text decides the reason
        total = self.state.scheduler.counts.total_params
        self.state.metrics.observe_request(self.request.tier, outcome, self.exchange.token_times, self.finish_reason, total)
        if outcome.finish_reason in ("stop", "length"):
            self.state.tiers.goodput.observe(self.request.tier, outcome.submitted_at, self.exchange.token_times)
            self.state.jitter.observe(self.request.tier, self.exchange.token_times)
        if outcome.finish_reason != "error":
            self.state.metrics.prompt_tokens.inc(len(self.prompt))
        return rest

    @property
    def finish_reason(self) -> Optional[str]:
        if self.outcome is None:
            return None
        if self.text.stopped or self.outcome.finish_reason == "stop":
            return "stop"
        if self.outcome.finish_reason == "cancelled":
            return "abort"
        return self.outcome.finish_reason

    def usage(self) -> dict:
        n = len(self.token_ids)
        out = {"prompt_tokens": len(self.prompt), "completion_tokens": n, "total_tokens": len(self.prompt) + n}
        if self.outcome is not None:
            out["moe"] = self.outcome.usage.as_dict()
        return out

    def _choice(self, text: str, ids: list[int], finish: Optional[str], delta: bool) -> dict:
        if self.chat:
            if delta:
                choice = {"index": 0, "delta": {"content": text} if text or finish is None else {}, "finish_reason": finish}
            else:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.with_ids:
            choice["token_ids"] = ids
        return choice

    def _frame(self, choices: list, usage: Optional[dict] = None) -> str:
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.state.config.model_name,
            "choices": choices,
        }
        if usage is not None:
            obj["usage"] = usage
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def whole(self, http: HttpRequest) -> JSONResponse:
        pieces: list[str] = []
        while True:
            try:
                kind, value = await asyncio.wait_for(self.exchange.queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    self.state.scheduler.cancel(self.request)
                continue
            if kind == "token":
                pieces.append(self._push(value))
                continue
            pieces.append(self.finish(value))
            break
        if self.outcome.finish_reason == "error":
            raise ApiError(500, f"generation failed: {self.outcome.error}", code="engine_error")
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.state.config.model_name,
            "choices": [self._choice("".join(pieces), self.token_ids, self.finish_reason, delta=False)],
            "usage": self.usage(),
        }
        return JSONResponse(body)

    async def events(self, first):
        finished = False
        try:
            if self.chat:
                yield self._frame([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            item = first
            while True:
                kind, value = item
                if kind == "token":
                    piece = self._push(value)
                    yield self._frame([self._choice(piece, [value], None, delta=True)])
                else:
                    finished = True
                    rest = self.finish(value)
                    if value.finish_reason == "error":
                        error = {"message": f"generation failed: {value.error}", "type": "server_error", "param": None, "code": "engine_error"}
                        yield f"data: {json.dumps({'error': error})}\n\n"
                    else:
                        yield self._frame([self._choice(rest, [], self.finish_reason, delta=True)])
                        if self.body.include_usage:
                            yield self._frame([], self.usage())
                    yield "data: [DONE]\n\n"
                    return
                item = await self.exchange.queue.get()
        finally:
            if not finished:
                # The client went away mid-stream: its row leaves at the next step, and its outcome
                # (maybe already queued) is still counted.
                self.state.scheduler.cancel(self.request)
                self.exchange.abandoned = self.finish
                while not self.exchange.queue.empty():
                    kind, value = self.exchange.queue.get_nowait()
                    if kind == "finish":
                        self.finish(value)
