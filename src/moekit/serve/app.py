"""The HTTP app: OpenAI's completion and chat routes, /v1/models, /health, /metrics, /openapi.json
and the tokenizer routes (moekit.serve.tokenizer_routes).

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
from moekit.serve.logprobs import chat_logprobs, completion_logprobs, token_text
from moekit.serve.openapi import openapi_document
from moekit.serve.protocol import ChatRequest, CompletionRequest, Sampled, parse_body
from moekit.serve.streaming import ID_MARK, TEXT_MARK, Dispatcher, Mailbox, cut_template
from moekit.serve.structured import asks_for_grammar, request_constraint
from moekit.engine.router_health import watch_routers
from moekit.serve.canary import HEADER as CANARY_HEADER, on_canary
from moekit.serve.health import EntropyCollector, JitterMetrics
from moekit.serve.sla import GoodputCollector, TierControl
from moekit.serve.text import StopText
from moekit.serve.threads import engine_threads, seat_http_thread
from moekit.serve.tools import ToolStream, content_or_none, render_prompt
from moekit.serve.validation import read_body
from moekit.serve.tokenizer_routes import register_tokenizer_routes

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# How long at most the decode step after a prefill waits for the event loop to write the first tokens'
# frames (moekit.engine.scheduler's first_token_wait_s): the loop's share of a token is ~0.1-0.2 ms of CPU
# (docs/BENCHMARKS.md), a first frame (response start, the reply's task) a few times that.
FIRST_FRAME_WAIT_S = 0.001


@dataclass
class ServeConfig:
    checkpoint: Path
    model_name: str
    dtype: str = "float32"
    device: str = "cpu"
    max_batch: int = 16
    max_context: Optional[int] = None  # slots per row; default the model's context
    queue_limit: int = 256  # waiting requests per tier before 429
    max_prefill_tokens: int = 128  # prompt tokens a step prefills; longer prompts in chunks (chunked prefill)
    max_body_bytes: int = 1 << 20
    offload: Optional[object] = None  # moekit.offload.options.OffloadOptions
    threads: Optional[int] = None
    share_cores: bool = False  # idle torch threads sleep between regions (moekit.serve.threads): --share-cores
    admin_token: Optional[str] = None  # enables the hot-swap routes (moekit.serve.admin)
    verify: bool = True  # check the weights against moekit-experts.json as they load (--no-verify: False)
    compile: bool = True  # decode steps as one compiled graph (the default; --eager: False; moekit.model.compiled_step)
    kernels: str = "auto"  # --kernels: "reference" never loads the C++ operators (moekit.ops)
    weights: str = "dtype"  # --weights: dtype, int8 or int8-experts (moekit.engine.loader.WEIGHTS)
    prefix_cache_bytes: int = 1 << 30  # --prefix-cache-memory: KV of prompt prefixes kept; 0: none
    tiers: dict = field(default_factory=dict)  # --tier: name -> moekit.serve.sla.TierTargets
    sla_action: str = "reject"  # --sla-action: what a request over its tier's TTFT target gets
    backend: Optional[object] = None  # loads and steps the engine elsewhere (moekit.serve.sharded: over ranks)
    progress: Optional[Callable[[str], None]] = None  # told what the compiled step's warm-up does, and its time
    first_frame_wait_s: float = FIRST_FRAME_WAIT_S  # 0: the decode after a first token never waits for its frame


@dataclass
class ServerState:
    config: ServeConfig
    engine: Optional[object] = None
    scheduler: Optional[object] = None
    template: Optional[object] = None
    error: Optional[str] = None
    fault: Optional[str] = None  # why a loaded server can serve no more (a peer rank failed): 503s
    on_fatal: Optional[Callable[[str], None]] = None  # the CLI stops the server on a load failure
    ready: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: Optional[threading.Thread] = None
    metrics: Optional[ServerMetrics] = None
    grammars: Optional[object] = None  # moekit.serve.structured.Grammars: response_format and forced tool calls
    tiers: Optional[TierControl] = None
    jitter: Optional[JitterMetrics] = None
    threads: Optional[int] = None  # the engine thread's torch threads, once it has set them
    prefill_graphs: Optional[threading.Thread] = None  # compiles the prefill graphs while the server answers
    graphs_ready: threading.Event = field(default_factory=threading.Event)  # every graph it will run is loaded
    dispatcher: Optional[Dispatcher] = None  # hands the engine thread's items to the event loop's replies

    def dispatcher_for(self, loop) -> Dispatcher:
        """The dispatcher of the loop that serves (made on the first request it serves)."""
        if self.dispatcher is None or self.dispatcher.loop is not loop:
            self.dispatcher = Dispatcher(loop)
        return self.dispatcher

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
        if self.prefill_graphs is not None:
            self.prefill_graphs.start()
        else:
            self.graphs_ready.set()
        if self.config.backend is not None:
            self.config.backend.run(self, self.stop)
        else:
            self.scheduler.run(self.stop)

    def _load(self) -> None:
        from moekit.engine.loader import load_engine
        from moekit.engine.prefix_cache import PrefixCache
        from moekit.engine.scheduler import Scheduler
        from moekit.serve.chat import load_chat_template
        from moekit.serve.structured import Grammars

        cfg = self.config
        self.threads = engine_threads(cfg.threads)
        if cfg.share_cores:  # idle torch threads then sleep, not spin, when they and the HTTP thread outnumber the cores
            seat_http_thread(self.stop, self.threads)
        if cfg.backend is not None:
            engine = cfg.backend.load(cfg)
        else:
            engine = load_engine(cfg.checkpoint, dtype=cfg.dtype, device=cfg.device, offload=cfg.offload, verify=cfg.verify,
                                 compile=cfg.compile, weights=cfg.weights, kernels=cfg.kernels)
        watch_routers(engine.decoder)  # routing entropy for /metrics (router health), eager or compiled
        if engine.decoder.compiled is not None:
            # Compiled before /health says ready, not on a request; tiers' per-row K graphs too. A server of
            # one row never steps a batch: no batch graph.
            engine.decoder.compiled.warm_up((1,) if cfg.max_batch == 1 else (1, 2), per_row_k=bool(cfg.tiers),
                                            say=cfg.progress, rows=cfg.max_batch)
        self.template = load_chat_template(Path(cfg.checkpoint))
        self.scheduler = Scheduler(
            engine.decoder,
            max_batch=cfg.max_batch,
            max_len=cfg.max_context,
            bytes_per_param=engine.bytes_per_param,
            expert_bytes=engine.expert_bytes,  # int8 / packed / paged experts at their real bytes
            dense_saving=engine.dense_saving,  # and int8 projections (--weights int8)
            queue_limit=cfg.queue_limit,
            prefill_tokens=cfg.max_prefill_tokens,
            store=engine.store,
            on_step=self._step_done,
            prefix_cache=PrefixCache(cfg.prefix_cache_bytes) if cfg.prefix_cache_bytes else None,
            first_token_wait_s=cfg.first_frame_wait_s,
        )
        self.grammars = Grammars(engine.tokenizer, engine.spec.vocab_size, tuple(engine.eos_ids))
        self.engine = engine
        self.prefill_graphs = self._prefill_graphs(engine.decoder)

    def _prefill_graphs(self, decoder) -> Optional[threading.Thread]:
        """The thread that compiles the scheduler's prefill graphs (moekit.model.compiled_step.served_prefills:
        those its prompts can take) once the server answers, not before: three graphs took a cold start from
        ~45 s to ~150 s here, and a prompt without its graph runs the modules' forward meanwhile (the same
        tokens). None where no prompt could take them (paged experts, hooks: moekit.model.prefill_step.takes)
        or nothing is compiled."""
        from moekit.model.compiled_step import served_prefills
        from moekit.model.prefill_step import takes

        if decoder.compiled is None or takes(decoder, None, None, last_only=True) is not None:
            return None
        shapes = served_prefills(self.config.max_batch, self.scheduler.max_len, self.scheduler.prefill_tokens)
        def load() -> None:
            decoder.compiled.warm_up_prefills(shapes, self.config.progress, self.stop)
            self.graphs_ready.set()

        return threading.Thread(target=load, name="moekit-prefill-graphs", daemon=True)

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


def warm_up_ahead(config: ServeConfig) -> None:
    """`moekit serve --warm-up`: load the engine as a server of config would, compile (or load) every
    graph it would use, the prefill graphs too, into the cache folder, and close it: a later server of
    the same options loads them (moekit.model.saved_graphs) and is ready in seconds."""
    state = ServerState(config=config)
    state._load()
    try:
        if state.prefill_graphs is not None:
            state.prefill_graphs.run()  # here, not on a thread: nothing is served meanwhile
    finally:
        state.engine.close()


def create_app(config: ServeConfig, on_ready: Optional[Callable[[ServerState], None]] = None) -> FastAPI:
    state = ServerState(config=config, tiers=TierControl.build(config.tiers, config.sla_action))
    state.metrics = ServerMetrics(state)
    state.metrics.registry.register(GoodputCollector(state.tiers.goodput))
    state.metrics.registry.register(EntropyCollector(state))
    state.jitter = JitterMetrics(state.metrics.registry)
    if config.backend is not None:
        config.backend.attach(state)  # its own /metrics

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
        response = error_response(err.status_code, str(err.detail), code=None)
        response.headers.update(err.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request, err: Exception):
        return error_response(500, f"internal error: {type(err).__name__}: {err}", code="internal_error")

    from moekit.serve.admin import register_admin_routes

    register_admin_routes(app, state)

    @app.get("/health")
    async def health():
        if state.fault is not None:
            return error_response(503, state.fault)
        if state.error is not None:
            return error_response(503, f"the model failed to load: {state.error}")
        if not state.ready.is_set():
            return error_response(503, "the model is loading")
        # Ready answers; "graphs" says whether prompts still run the modules' forward while their graphs load.
        return JSONResponse({"status": "ok", "graphs": "ready" if state.graphs_ready.is_set() else "loading"})

    def model_card() -> dict:
        card = {"id": config.model_name, "object": "model", "created": int(time.time()), "owned_by": "moekit"}
        if state.scheduler is not None:
            card["max_model_len"] = state.scheduler.max_len
        return card

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):  # the official client's models.retrieve
        if model_id != config.model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {config.model_name!r}",
                           "model", "model_not_found")
        return JSONResponse(model_card())

    @app.get("/openapi.json")
    async def openapi():
        return JSONResponse(openapi_document(app.version))

    register_tokenizer_routes(app, state)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        arrived = time.perf_counter()
        body = parse_body(await read_body(http, config.max_body_bytes), CompletionRequest)
        engine = _ready_engine(state, body)
        if any(isinstance(p, str) for p in body.prompts) and engine.tokenizer is None:
            raise bad_request("this model has no tokenizer.json: send the prompt as a list of token ids", "prompt")
        prompts = [engine.encode(p) if isinstance(p, str) else list(p) for p in body.prompts]
        for ids in prompts:
            check_vocab(engine, ids)  # before echo decodes them
        echoed = None
        if body.echo:
            echoed = [p if isinstance(p, str) else (engine.decode(p) if engine.tokenizer is not None else "") for p in body.prompts]
        constraint = await _constraint(state, body)
        return await _generate(http, state, body, prompts, body.output_limit, chat=False, echoed=echoed, constraint=constraint,
                               arrived=arrived)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        arrived = time.perf_counter()
        body = parse_body(await read_body(http, config.max_body_bytes), ChatRequest)
        engine = _ready_engine(state, body)
        if engine.tokenizer is None:
            raise bad_request("this model has no tokenizer.json: chat needs text; use /v1/completions with token ids")
        try:
            text = render_prompt(state.template, body)
        except MoekitError as err:
            raise bad_request(str(err), "messages") from None
        ids = list(engine.tokenizer.encode(text, add_special_tokens=False).ids)
        constraint = await _constraint(state, body)
        tools = [t.function.name for t in body.tools] if body.tool_mode != "none" else None
        return await _generate(http, state, body, [ids], body.output_limit, chat=True, constraint=constraint, tools=tools,
                               arrived=arrived)

    return app


async def _constraint(state: ServerState, body: Sampled):
    """The request's grammar, compiled off the event loop (a schema can take a while); a free-text
    request, most of them, skips the hop to a worker thread and back (two thread switches in its
    time to first token, each of which waits for the GIL while the engine thread runs Python)."""
    if not asks_for_grammar(body):
        return None
    return await asyncio.to_thread(request_constraint, state.grammars, body)


def _announce(state: ServerState, on_ready) -> None:
    while not state.ready.wait(0.2):
        if state.error is not None or state.stop.is_set():
            return
    on_ready(state)


def _ready_engine(state: ServerState, body: Sampled):
    if state.fault is not None:
        raise ApiError(503, state.fault)
    if state.error is not None:
        raise ApiError(503, f"the model failed to load: {state.error}")
    if not state.ready.is_set():
        raise ApiError(503, "the model is loading; retry when /health answers 200")
    if body.model is not None and body.model != state.config.model_name:
        raise ApiError(
            404, f"the model {body.model!r} does not exist; this server serves {state.config.model_name!r}", "model", "model_not_found"
        )
    return state.engine


def _failed(state: ServerState, outcome) -> ApiError:
    """A request whose generation failed: 503 when the server as a whole can serve no more."""
    if state.fault is not None:
        return ApiError(503, state.fault)
    return ApiError(500, f"generation failed: {outcome.error}", code="engine_error")


def _request_for(state: ServerState, body: Sampled, ids: list[int], max_tokens: Optional[int], copy: int = 0):
    """The scheduler Request for one prompt of a validated body (its `copy`-th continuation),
    or a 400 naming the field at fault."""
    from moekit.engine.scheduler import Request

    scheduler, engine = state.scheduler, state.engine
    check_vocab(engine, ids)
    room = scheduler.max_len - len(ids)
    if room <= 0:
        raise bad_request(f"the prompt has {len(ids)} tokens; the context holds {scheduler.max_len}", "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(DEFAULT_COMPLETION_TOKENS, room) if isinstance(body, CompletionRequest) else room
    scoring = isinstance(body, CompletionRequest) and body.echo
    if max_tokens < (0 if scoring else 1):
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
        # The n continuations of a seeded request draw from n streams: seed, seed+1, … (mod 2**64).
        seed=None if body.seed is None else _nth_seed(body.seed, copy),
    )
    return Request(
        prompt=ids,
        max_new_tokens=max_tokens,
        sampling=sampling,
        stop_ids=() if body.ignore_eos else tuple(engine.eos_ids),
        tier=tier,
        top_k=top_k,
        priority=body.priority,
        routing=routing,
        logprobs=_token_logprobs(body),
        prompt_logprobs=(body.logprobs or 0) if scoring and (body.logprobs is not None or max_tokens == 0) else None,
    )


def check_vocab(engine, ids: list[int]) -> None:
    vocab = engine.spec.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")


def _nth_seed(seed: int, copy: int) -> int:
    return seed if copy == 0 else (seed + copy) % 2**64  # in 0..2**64-1: a seed torch takes


def _token_logprobs(body: Sampled) -> Optional[int]:
    """How many top logprobs each generated token asks for (None: no logprobs)."""
    if isinstance(body, ChatRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


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
        return parse_policy(moe.routing, scheduler.model_k, scheduler.num_experts)
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

        request.routing = parse_policy(policy, state.scheduler.model_k, state.scheduler.num_experts)  # checked when the server started


@dataclass
class _Exchange:
    """One HTTP request's traffic between the engine thread and the event loop: (choice, kind, value)
    items in its mailbox (moekit.serve.streaming), and each choice's token times (engine thread)."""

    box: Mailbox = field(default_factory=Mailbox)
    token_times: dict[int, list[float]] = field(default_factory=dict)


def _wire(request, index: int, exchange: _Exchange, dispatcher: Dispatcher) -> None:
    """The request's callbacks (engine thread) put into the exchange's mailbox (event loop)."""
    times = exchange.token_times.setdefault(index, [])
    box, put = exchange.box, dispatcher.put

    def on_token(token: int) -> None:
        times.append(time.perf_counter())
        put(box, (index, "token", token))

    request.on_token = on_token
    request.on_finish = lambda outcome: put(box, (index, "finish", outcome))
    request.on_logprob = lambda entry: put(box, (index, "logprob", entry))
    request.on_prompt_logprobs = lambda entries: put(box, (index, "prompt", entries))


async def _generate(http: HttpRequest, state: ServerState, body: Sampled, prompts: list[list[int]], max_tokens,
                    chat: bool, echoed: Optional[list[str]] = None, constraint=None, tools: Optional[list[str]] = None,
                    arrived: Optional[float] = None):
    """One scheduler request per prompt and continuation (choice index prompt * n + copy), queued
    together so that a prompt's continuations share its prefill. constraint: a grammar every choice
    follows (each row gets its own copy: a matcher follows one row's tokens); tools: the names of
    the functions whose calls are parsed from the output (None: no tools); arrived: when the HTTP
    request reached its route (time.perf_counter())."""
    from moekit.engine.scheduler import QueueFull

    requests = [_request_for(state, body, ids, max_tokens, copy) for ids in prompts for copy in range(body.n)]
    if constraint is not None:
        for i, request in enumerate(requests):
            request.constraint = constraint if i == 0 else constraint.copy()
    exchange = _Exchange()
    dispatcher = state.dispatcher_for(asyncio.get_running_loop())
    for index, request in enumerate(requests):
        _wire(request, index, exchange, dispatcher)
        if body.stream:  # its first frame goes out before the next decode step takes the cores (_Reply.events)
            request.first_passed = threading.Event()
    canary = on_canary(state.scheduler.canary, http.headers.get(CANARY_HEADER))
    for request in requests:
        _place(state, request)
        request.canary = canary
    try:
        state.scheduler.submit_all(requests)
    except QueueFull as err:
        raise ApiError(429, str(err), code="rate_limit_exceeded") from None
    except MoekitError as err:
        raise bad_request(str(err)) from None
    tool_stream = (lambda: ToolStream(tools)) if tools is not None else (lambda: None)
    reply = _Reply(state, body, requests, [ids for ids in prompts for _ in range(body.n)], chat, exchange,
                   None if echoed is None else [text for text in echoed for _ in range(body.n)], tool_stream, arrived)
    if body.stream:
        first = await exchange.box.take(asyncio.get_running_loop())  # a request that fails before its first token answers 500
        if first[0][1] == "finish" and first[0][2].finish_reason == "error":
            reply.fail(first[0], first[1:])
            raise _failed(state, first[0][2])
        return StreamingResponse(reply.events(first), media_type="text/event-stream", headers={"cache-control": "no-cache"})
    return await reply.whole(http)


class _Choice:
    """One continuation: its text (cut at stop strings), ids, logprobs and outcome."""

    def __init__(self, index: int, request, prompt: list[int], tokenizer, stops: list[str], echo: Optional[str],
                 tools: Optional[ToolStream] = None):
        self.index, self.request, self.prompt = index, request, prompt
        self.text = StopText(tokenizer, stops)
        self.tools = tools  # calls held back from the content, parsed at the end
        self.token_ids: list[int] = []
        self.logprobs: list = []  # TokenLogprob of each generated token, when asked
        self.prompt_logprobs: Optional[list] = None  # of each prompt token (echo), when asked
        self.echo = echo  # the prompt's text, sent before the completion
        self.outcome = None
        self.sent = 0  # logprobs already streamed
        self.first_sent: Optional[float] = None  # when its first token's frame was written (streaming)

    def push(self, token: int) -> str:
        self.token_ids.append(token)
        piece = self.text.push(token)
        return piece if self.tools is None else self.tools.push(piece)

    @property
    def finish_reason(self) -> Optional[str]:
        if self.outcome is None:
            return None
        if self.calls:
            return "tool_calls"
        if self.text.stopped or self.outcome.finish_reason == "stop":
            return "stop"
        if self.outcome.finish_reason == "cancelled":
            return "abort"
        return self.outcome.finish_reason

    @property
    def calls(self) -> list[dict]:
        return self.tools.calls if self.tools is not None else []

class _Reply:
    """Builds a response from its choices' tokens: texts, ids, logprobs and usage."""

    def __init__(self, state: ServerState, body: Sampled, requests: list, prompts: list[list[int]], chat: bool,
                 exchange: _Exchange, echoed: Optional[list[str]] = None,
                 tool_stream: Callable[[], Optional[ToolStream]] = lambda: None, arrived: Optional[float] = None):
        self.state, self.body, self.chat = state, body, chat
        self.arrived = arrived
        self.exchange = exchange
        tokenizer = state.engine.tokenizer
        self.choices = [
            _Choice(i, request, prompt, tokenizer, body.stops, None if echoed is None else echoed[i], tool_stream())
            for i, (request, prompt) in enumerate(zip(requests, prompts))
        ]
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.with_ids = body.return_token_ids or tokenizer is None
        self.token_text = token_text(tokenizer)
        self.open = len(self.choices)  # choices not finished yet
        self.templates: dict[int, object] = {}  # choice index → its token chunk's FrameTemplate (False: none)

    def _take(self, item) -> Optional[str]:
        """One item from the engine: the text a token releases, else None (bookkeeping only)."""
        index, kind, value = item
        choice = self.choices[index]
        if kind == "logprob":
            choice.logprobs.append(value)
            return None
        if kind == "prompt":
            choice.prompt_logprobs = value
            return None
        if kind == "token":
            piece = choice.push(value)
            if choice.text.stopped and not choice.request.cancelled:
                self.state.scheduler.cancel(choice.request)  # a stop string: the row leaves at the next step
            return piece
        return self.finish(index, value)

    def finish(self, index: int, outcome) -> str:
        """A choice ended: record it in the metrics, return the text still held back."""
        choice = self.choices[index]
        if choice.outcome is not None:
            return ""
        choice.outcome = outcome
        self.open -= 1
        rest = choice.text.flush()  # first: a stop string in the held-back text decides the reason
        if choice.tools is not None:
            rest = choice.tools.finish(rest)
        total = self.state.scheduler.counts.total_params
        times = self.exchange.token_times.get(index, [])
        self.state.metrics.observe_request(choice.request.tier, outcome, times, choice.finish_reason, total,
                                           self.arrived, choice.first_sent)
        if outcome.finish_reason in ("stop", "length"):
            self.state.tiers.goodput.observe(choice.request.tier, outcome.submitted_at, times)
            self.state.jitter.observe(choice.request.tier, times)
        if outcome.finish_reason != "error" and index % self.body.n == 0:  # a shared prefill counts once
            self.state.metrics.prompt_tokens.inc(len(choice.prompt))
        return rest

    def fail(self, item, rest: list = ()) -> None:
        """One choice failed: the others are cancelled (the client gets one error for the request),
        and their outcomes (`rest`: items taken with the failure; the mailbox's, now or to come) go
        straight to the metrics."""
        self.finish(item[0], item[2])
        self.abandon(rest)

    def abandon(self, taken: list = ()) -> None:
        """Nobody reads this reply any more: its running choices leave at the next step, and their
        outcomes (maybe already taken or in the mailbox) are still counted."""
        for choice in self.choices:
            if choice.outcome is None:
                self.state.scheduler.cancel(choice.request)
        box = self.exchange.box
        box.abandoned = self._count_outcome
        for item in [*taken, *box.drain()]:
            self._count_outcome(item)

    def _count_outcome(self, item) -> None:
        index, kind, value = item
        if kind == "finish":
            self.finish(index, value)

    def usage(self) -> dict:
        prompt = sum(len(c.prompt) for c in self.choices if c.index % self.body.n == 0)
        generated = sum(len(c.token_ids) for c in self.choices)
        out = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
        if len(self.choices) == 1 and self.choices[0].outcome is not None:
            out["moe"] = self.choices[0].outcome.usage.as_dict()
        finished = [c.outcome for c in self.choices if c.outcome is not None and c.index % self.body.n == 0]
        if finished:
            out["prompt_tokens_details"] = {"cached_tokens": sum(o.cached_tokens for o in finished)}
        return out

    def _logprobs(self, choice: _Choice, tokens: list[int], entries: list, echo: bool) -> Optional[dict]:
        if self.chat:
            return chat_logprobs(entries, self.token_text) if choice.request.logprobs is not None else None
        if choice.request.logprobs is None:
            return None
        if echo:  # the prompt's tokens first, then the generated ones
            prompt = choice.prompt_logprobs or [None] * len(choice.prompt)
            return completion_logprobs([*prompt, *entries], [*choice.prompt, *tokens], self.token_text)
        return completion_logprobs(entries, tokens, self.token_text)

    def _choice(self, choice: _Choice, text: str, ids: list[int], entries: list, finish: Optional[str], delta: bool,
                echo: bool = False) -> dict:
        if self.chat:
            if delta:
                out = {"index": choice.index, "delta": {"content": text} if text or finish is None else {}}
                if finish is not None and choice.calls:
                    out["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(choice.calls)]
            else:
                message = {"role": "assistant", "content": content_or_none(text, choice.calls)}
                if choice.calls:
                    message["tool_calls"] = choice.calls
                out = {"index": choice.index, "message": message}
            out["logprobs"] = self._logprobs(choice, ids, entries, False)
            out["finish_reason"] = finish
        else:
            echo = echo and choice.echo is not None  # a completion asked for echo
            if echo:
                text = choice.echo + text
            out = {"index": choice.index, "text": text, "logprobs": self._logprobs(choice, ids, entries, echo),
                   "finish_reason": finish}
            if echo and self.with_ids:
                out["prompt_token_ids"] = choice.prompt
        if self.with_ids:
            out["token_ids"] = ids
        if len(self.choices) > 1 and choice.outcome is not None and not delta:
            out["moe"] = choice.outcome.usage.as_dict()
        return out

    def _frame(self, choices: list, usage: Optional[dict] = None) -> str:
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.state.config.model_name,
            "choices": choices,
        }
        if usage is None and choices and self.body.continuous_usage:
            usage = self.usage()  # the tokens so far: vLLM's continuous_usage_stats
        if usage is not None:
            obj["usage"] = usage
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def whole(self, http: HttpRequest) -> JSONResponse:
        pieces: list[list[str]] = [[] for _ in self.choices]
        loop = asyncio.get_running_loop()
        while self.open:
            try:
                items = await asyncio.wait_for(self.exchange.box.take(loop), timeout=0.25)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    for choice in self.choices:
                        self.state.scheduler.cancel(choice.request)
                continue
            for n, item in enumerate(items):
                if item[1] == "finish" and item[2].finish_reason == "error":
                    self.fail(item, items[n + 1:])
                    raise _failed(self.state, item[2])
                piece = self._take(item)
                if piece:
                    pieces[item[0]].append(piece)
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.state.config.model_name,
            "choices": [
                self._choice(c, "".join(pieces[c.index]), c.token_ids, c.logprobs, c.finish_reason, delta=False, echo=True)
                for c in self.choices
            ],
            "usage": self.usage(),
        }
        return JSONResponse(body)

    def _token_frame(self, choice: _Choice, piece: str, token: int) -> str:
        """A token's chunk that carries only its text (and id): from the choice's template."""
        template = self.templates.get(choice.index)
        if template is None:
            reference = self._frame([self._choice(choice, TEXT_MARK, [ID_MARK], [], None, True)])
            template = self.templates[choice.index] = cut_template(reference, self.with_ids) or False
        if template is False:  # no template for this chunk's form: the reference, every time
            return self._frame([self._choice(choice, piece, [token], [], None, True)])
        return template.frame(piece, token)

    def _plain(self, choice: _Choice) -> bool:
        """Whether a token's chunk of this choice holds only its text and id (the template's form)."""
        return choice.request.logprobs is None and not self.body.continuous_usage

    def _mark_first_sent(self) -> None:
        """After a write: each choice whose first token's frame was in it has been sent now (and the
        engine thread, waiting for that before its next decode step, goes on)."""
        now = time.perf_counter()
        for choice in self.choices:
            if choice.first_sent is None and choice.token_ids:
                choice.first_sent = now
                choice.request.first_passed.set()

    def _release_engine(self) -> None:
        """The stream has ended: the engine thread waits for none of its first frames any more."""
        for choice in self.choices:
            if choice.request.first_passed is not None:
                choice.request.first_passed.set()

    async def events(self, first: list):
        """The SSE stream: every item taken at once is written at once (one write, several frames)."""
        finished = False
        echoed: set[int] = set()
        loop = asyncio.get_running_loop()
        frames: list[str] = []
        try:
            if self.chat:
                frames.append(self._frame([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None} for c in self.choices]))
            items = first
            while True:
                for n, item in enumerate(items):
                    index, kind, value = item
                    choice = self.choices[index]
                    if kind == "finish" and value.finish_reason == "error":
                        finished = True
                        self.fail(item, items[n + 1:])
                        failure = _failed(self.state, value)
                        frames.append(f"data: {failure.response().body.decode()}\n\n")
                        frames.append("data: [DONE]\n\n")
                        yield "".join(frames)
                        return
                    if kind == "finish" and frames and choice.first_sent is None and choice.token_ids:
                        yield "".join(frames)  # its first token's frame before its end: the stream stage is timed
                        frames = []
                        self._mark_first_sent()
                    piece = self._take(item)
                    if kind == "token" and self._plain(choice) and (self.chat or not self.body.echo or index in echoed):
                        frames.append(self._token_frame(choice, piece, value))
                    elif kind in ("token", "finish"):
                        echo = not self.chat and self.body.echo and index not in echoed
                        if echo:
                            echoed.add(index)
                        entries, choice.sent = choice.logprobs[choice.sent :], len(choice.logprobs)
                        ids, reason = ([value], None) if kind == "token" else ([], choice.finish_reason)
                        frames.append(self._frame([self._choice(choice, piece, ids, entries, reason, True, echo)]))
                    if not self.open:
                        finished = True
                        if self.body.include_usage:
                            frames.append(self._frame([], self.usage()))
                        frames.append("data: [DONE]\n\n")
                        yield "".join(frames)
                        return
                if frames:
                    yield "".join(frames)
                    frames = []
                    self._mark_first_sent()
                items = await self.exchange.box.take(loop)
        finally:
            self._release_engine()
            if not finished:  # the client went away mid-stream
                self.abandon()
