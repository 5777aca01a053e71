"""`moekit bench serve URL`: a load generator for any OpenAI-compatible completions endpoint.

Each request streams (`stream: true`) a fixed number of tokens (`ignore_eos`, which vLLM and
llama-server accept too), so every server does the same work. Per request: TTFT (send → first
token chunk), the gaps between token chunks (ITL) and end-to-end time; per load level: output
tokens/s over the level's wall time, percentiles, errors, and — for moekit — the mean active share
from `usage.moe`. Load is either a fixed concurrency (N clients, each sending its next request when
the last ends) or an open-loop request rate (Poisson arrivals).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from moekit.errors import MoekitError

Prompt = Union[str, list[int]]

# Used when no prompts are given: a spread of the bundled model's domains (code, shell, man pages, prose).
DEFAULT_PROMPTS = [
    "def parse_args(argv):",
    "import os\nimport sys\n\n",
    "NAME\n    grep - print lines that match patterns\n\nSYNOPSIS\n",
    "#!/bin/sh\nset -e\n",
    "class LRUCache:\n    def __init__(self, capacity):",
    "The quick brown fox jumps over",
    "for file in *.txt; do",
    "DESCRIPTION\n    The tar program",
]


@dataclass
class RequestResult:
    ok: bool
    status: int = 0
    error: str = ""
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    active_share: Optional[float] = None


@dataclass
class LevelResult:
    """One load level: a concurrency, or a request rate (requests/s)."""

    concurrency: Optional[int]
    rate: Optional[float]
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    ttft_s: dict[str, float]
    itl_s: dict[str, float]
    e2e_s: dict[str, float]
    mean_active_share: Optional[float]
    first_error: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 (linear interpolation between closest ranks) and the mean; NaN when empty."""
    if not values:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p99")}
    ordered = sorted(values)

    def at(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"mean": statistics.fmean(ordered), "p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


def summarize(results: list[RequestResult], wall_s: float, concurrency: Optional[int], rate: Optional[float]) -> LevelResult:
    good = [r for r in results if r.ok]
    shares = [r.active_share for r in good if r.active_share is not None]
    tokens = sum(r.output_tokens for r in good)
    errors = [r for r in results if not r.ok]
    return LevelResult(
        concurrency=concurrency,
        rate=rate,
        requests=len(results),
        errors=len(errors),
        wall_s=wall_s,
        output_tokens=tokens,
        output_tok_s=tokens / wall_s if wall_s > 0 else float("nan"),
        ttft_s=percentiles([r.ttft_s for r in good]),
        itl_s=percentiles([gap for r in good for gap in r.itl_s]),
        e2e_s=percentiles([r.e2e_s for r in good]),
        mean_active_share=statistics.fmean(shares) if shares else None,
        first_error=errors[0].error if errors else "",
    )


def token_count(chunk: dict) -> int:
    """Tokens a streamed completions chunk carries: its token ids when listed, else one per chunk
    before the closing one. Not one per chunk with text: a token that ends inside a UTF-8
    character streams as an empty text, and it is still a token the server produced."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    return 0 if choice.get("finish_reason") else 1


async def one_request(client, url: str, body: dict) -> RequestResult:
    """POST one streaming completion and time its token chunks."""
    started = time.perf_counter()
    result = RequestResult(ok=False)
    arrivals: list[float] = []
    usage = None
    try:
        async with client.stream("POST", url, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                now = time.perf_counter()
                for _ in range(token_count(chunk)):
                    arrivals.append(now)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except Exception as err:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.e2e_s = time.perf_counter() - started
    result.output_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else len(arrivals)
    if arrivals:
        result.ttft_s = arrivals[0] - started
        # Tokens that share one chunk arrive together: their gaps are 0, as a client sees them.
        result.itl_s = [b - a for a, b in zip(arrivals, arrivals[1:])]
    moe = (usage or {}).get("moe") or {}
    result.active_share = moe.get("active_share")
    result.ok = result.output_tokens > 0
    if not result.ok:
        result.error = "no tokens came back"
    return result


@dataclass
class LoadPlan:
    url: str  # the server's base, e.g. http://127.0.0.1:8000 (with or without /v1)
    prompts: list[Prompt]
    max_tokens: int = 64
    model: Optional[str] = None  # None: the first model /v1/models lists
    extra: dict = field(default_factory=dict)  # merged into every body, e.g. {"moe": {"tier": "B"}}
    timeout_s: float = 600.0

    @property
    def completions_url(self) -> str:
        base = self.url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + "/completions"

    def body(self, i: int) -> dict:
        body = {
            "prompt": self.prompts[i % len(self.prompts)],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra,
        }
        if self.model is not None:
            body["model"] = self.model
        return body


@dataclass(frozen=True)
class Arrivals:
    """Long-prompt requests sent beside a concurrency level: one each time another
    requests / (count + 1) of the level's requests have finished, so they land mid-run whatever
    the server's speed."""

    plan: LoadPlan
    count: int


async def _run_concurrency(plan: LoadPlan, concurrency: int, requests: int, progress,
                           arrivals: Optional[Arrivals] = None) -> tuple[list[RequestResult], float, list[RequestResult]]:
    """The level's results and wall time (until its last request ends), and the arrivals' results."""
    import httpx

    next_index = iter(range(requests))
    results: list[RequestResult] = []
    extra = arrivals.count if arrivals else 0
    every = max(requests // (extra + 1), 1)
    sent: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=concurrency + extra, max_keepalive_connections=concurrency + extra)
    async with httpx.AsyncClient(timeout=httpx.Timeout(plan.timeout_s), limits=limits) as client:

        async def worker() -> None:
            for i in next_index:
                results.append(await one_request(client, plan.completions_url, plan.body(i)))
                progress()
                if len(sent) < extra and len(results) % every == 0:
                    body = arrivals.plan.body(len(sent))
                    sent.append(asyncio.create_task(one_request(client, arrivals.plan.completions_url, body)))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
        return results, wall, list(await asyncio.gather(*sent))


async def _run_rate(plan: LoadPlan, rate: float, requests: int, seed: int, progress) -> tuple[list[RequestResult], float]:
    import httpx

    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(plan.timeout_s), limits=httpx.Limits(max_connections=None)) as client:

        async def send(i: int, delay: float) -> RequestResult:
            await asyncio.sleep(delay)
            result = await one_request(client, plan.completions_url, plan.body(i))
            progress()
            return result

        delays, t = [], 0.0
        for _ in range(requests):
            delays.append(t)
            t += rng.expovariate(rate)
        started = time.perf_counter()
        results = await asyncio.gather(*(send(i, d) for i, d in enumerate(delays)))
        return list(results), time.perf_counter() - started


def first_model(url: str, timeout_s: float = 10.0) -> Optional[str]:
    """The id of the first model the server lists, or None when it lists none."""
    import httpx

    base = url.rstrip("/")
    models_url = (base if base.endswith("/v1") else base + "/v1") + "/models"
    try:
        data = httpx.get(models_url, timeout=timeout_s).json().get("data") or []
    except (httpx.HTTPError, ValueError) as err:
        raise MoekitError(f"{models_url}: no OpenAI-compatible server answers there ({type(err).__name__})") from None
    return data[0].get("id") if data else None


def run_level(
    plan: LoadPlan,
    requests: int,
    concurrency: Optional[int] = None,
    rate: Optional[float] = None,
    seed: int = 0,
    progress: Callable[[], None] = lambda: None,
    warmup: int = 0,
) -> LevelResult:
    """One load level; `warmup` requests are sent first (one at a time) and not counted."""
    if (concurrency is None) == (rate is None):
        raise MoekitError("give a concurrency or a request rate")
    if warmup:
        asyncio.run(_run_concurrency(plan, 1, warmup, lambda: None))
    if concurrency is not None:
        results, wall, _ = asyncio.run(_run_concurrency(plan, concurrency, requests, progress))
    else:
        results, wall = asyncio.run(_run_rate(plan, rate, requests, seed, progress))
    return summarize(results, wall, concurrency, rate)


def run_arrivals_level(plan: LoadPlan, requests: int, concurrency: int, arrivals: Arrivals,
                       progress: Callable[[], None] = lambda: None, warmup: int = 0) -> tuple[LevelResult, LevelResult]:
    """A concurrency level with long prompts arriving during it: the level's summary (its own
    requests only, over its wall time) and the arrivals' (their TTFT is the prefill they waited for)."""
    if warmup:
        asyncio.run(_run_concurrency(plan, 1, warmup, lambda: None))
    results, wall, late = asyncio.run(_run_concurrency(plan, concurrency, requests, progress, arrivals))
    return summarize(results, wall, concurrency, None), summarize(late, wall, None, None)


def load_prompts(path: Optional[Path], random_ids: Optional[int], vocab: int, count: int, seed: int) -> list[Prompt]:
    """Prompts from a file (one per line, or JSONL objects with "prompt": text or ids), random token
    ids of one length (the same ids for every server compared), or DEFAULT_PROMPTS."""
    if path is not None and random_ids is not None:
        raise MoekitError("give --prompts or --random-ids, not both")
    if random_ids is not None:
        if random_ids < 1 or vocab < 2:
            raise MoekitError("--random-ids needs a length of at least 1 and --vocab of at least 2")
        rng = random.Random(seed)
        return [[rng.randrange(1, vocab) for _ in range(random_ids)] for _ in range(count)]
    if path is None:
        return list(DEFAULT_PROMPTS)
    if not path.is_file():
        raise MoekitError(f"--prompts {path}: no such file")
    prompts: list[Prompt] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                value = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise MoekitError(f"{path}:{n}: a JSON line needs a \"prompt\" field") from None
            prompts.append(value)
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise MoekitError(f"--prompts {path}: the file holds no prompt")
    return prompts
