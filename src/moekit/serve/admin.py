"""Hot swap: replace one routed expert of a running server, blue-green, and roll it back.

  POST /admin/experts/{layer}/{expert}            body: a safetensors file holding the expert
  POST /admin/experts/{layer}/{expert}?canary=0.1 the same, served to that share of new requests first
  POST /admin/experts/{layer}/{expert}/promote    the canary's weights served to every request
  POST /admin/experts/{layer}/{expert}/rollback   the weights it had before the last swap (or: end its canary)

Each expert keeps a history of the weights its swaps replaced (the last HISTORY of them), so
rollbacks can be repeated, each undoing one more swap, back to the checkpoint's weights.

Only with `--admin-token` set, and then only for `Authorization: Bearer <token>` (401 without a
token, 403 with another). The file holds `gate_proj.weight` [F, D] and `up_proj.weight` [F, D]
(gated experts) and `down_proj.weight` [D, F], the Hub's per-expert names. The new weights are
checked (names, shapes, floating dtype, finite values, and the body's sha256 against an
`x-checksum-sha256` header when one is sent) and laid out for the expert's kernels in a staging
slot off the engine thread; the switch itself runs on the scheduler's thread between two decode
steps, so no step mixes old and new weights. The answer tells how many tokens each running request
had generated when the switch came.

Paged experts (--expert-memory): the new weights go to a file of their own that the store reads
instead of the checkpoint (moekit.offload.overlay; the checkpoint is never written), and the store
forgets any copy it holds at the switch; a rollback points the store back. A canary needs resident
experts (its rows run on weights the batch does not), and so does a store with int4 stand-ins
(--substitute: the stand-in would keep the old weights); both are a 409.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Optional

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse

from moekit.serve.canary import Canary, parse_share
from moekit.serve.errors import ApiError, bad_request


def check_token(configured: Optional[str], header: Optional[str]) -> None:
    if not configured:
        raise ApiError(403, "admin routes are off: start the server with --admin-token", code="admin_disabled")
    if not header or not header.startswith("Bearer "):
        raise ApiError(401, "admin routes need 'Authorization: Bearer <token>'", code="missing_token")
    if not hmac.compare_digest(header[len("Bearer ") :].encode(), configured.encode()):
        raise ApiError(403, "wrong admin token", code="wrong_token")


def expert_module(decoder, layer: int, expert: int):
    """The RoutedExperts of MoE layer `layer`, checked to hold expert `expert` (resident or paged)."""
    from moekit.model.moe import MoE

    if not 0 <= layer < len(decoder.layers) or not isinstance(decoder.layers[layer].ffn, MoE):
        moe = [i for i, b in enumerate(decoder.layers) if isinstance(b.ffn, MoE)]
        raise ApiError(404, f"layer {layer} is not an MoE layer (MoE layers: {moe[0]}..{moe[-1]})", "layer", "not_found")
    experts = decoder.layers[layer].ffn.experts
    if not 0 <= expert < experts.num_experts:
        raise ApiError(404, f"expert {expert} is out of range (0..{experts.num_experts - 1})", "expert", "not_found")
    if experts.gate_up_bias is not None:
        raise ApiError(409, "hot swap does not support experts with biases (gpt_oss) yet", code="unsupported")
    return experts


def is_paged(experts) -> bool:
    """Whether the experts live in the expert store (--expert-memory), not in this process's memory
    or on the ranks of --expert-parallel (a store that takes replace_expert itself)."""
    return experts.store is not None and not hasattr(experts.store, "replace_expert")


def replace_expert(experts, e: int, weights):
    """Expert e's weights ← `weights`, → the replaced ones: in this process, or, with
    --expert-parallel, on every rank holding a copy (moekit.dist.serving.LeaderStore)."""
    target = experts.store if experts.store is not None else experts
    return target.replace_expert(e, weights)


def parse_expert_file(raw: bytes, spec, dtype, checksum: Optional[str]):
    """Safetensors bytes → (gate_up [rows, D], down [D, F]) at the engine dtype, or a 400 that says why."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load

    digest = hashlib.sha256(raw).hexdigest()
    if checksum is not None and checksum.lower() != digest:
        raise bad_request(f"the body's sha256 is {digest}, not the {checksum} the x-checksum-sha256 header promised")
    try:
        tensors = load(raw)
    except (SafetensorError, Exception) as err:  # a malformed header raises several kinds
        raise bad_request(f"the body is not a safetensors file ({type(err).__name__})") from None
    width, hidden = spec.width, spec.hidden_size
    want = {"down_proj.weight": (hidden, width), "up_proj.weight": (width, hidden)}
    if spec.gated:
        want["gate_proj.weight"] = (width, hidden)
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise bad_request(f"the file must hold exactly {sorted(want)}; missing {missing}, unexpected {extra}")
    for name, shape in want.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise bad_request(f"{name} has shape {list(t.shape)}; this model's experts need {list(shape)}")
        if not t.is_floating_point():
            raise bad_request(f"{name} is {t.dtype}; expert weights must be floating point")
        if not bool(torch.isfinite(t).all()):
            raise bad_request(f"{name} holds NaN or infinite values")
    parts = [tensors["gate_proj.weight"], tensors["up_proj.weight"]] if spec.gated else [tensors["up_proj.weight"]]
    gate_up = torch.cat(parts).to(dtype).contiguous()
    return gate_up, tensors["down_proj.weight"].to(dtype).contiguous(), digest


@dataclass(frozen=True)
class PagedSource:
    """What a paged expert's loads read before a swap: a swapped-in file, or None (the checkpoint)."""

    path: Optional[object]


HISTORY = 16  # swaps remembered per expert; a 17th forgets the oldest (its memory is one expert's weights)


@dataclass
class Swaps:
    """Per swapped expert, the weights each of its swaps replaced, newest last: a stack of rollbacks."""

    previous: dict[tuple[int, int], list] = field(default_factory=dict)

    def push(self, key: tuple[int, int], old) -> int:
        stack = self.previous.setdefault(key, [])
        stack.append(old)
        del stack[:-HISTORY]
        return len(stack)

    def pop(self, key: tuple[int, int]):
        stack = self.previous.get(key)
        if not stack:
            return None
        old = stack.pop()
        if not stack:
            del self.previous[key]
        return old

    def depth(self, key: tuple[int, int]) -> int:
        return len(self.previous.get(key, ()))


def register_admin_routes(app: FastAPI, state) -> None:
    swaps = Swaps()

    def _allowed(http: HttpRequest) -> None:
        check_token(state.config.admin_token, http.headers.get("authorization"))
        if not state.ready.is_set():
            raise ApiError(503, "the model is loading")

    async def _switch(fn):
        future = state.scheduler.between_steps(fn)
        return await asyncio.wrap_future(future)

    @app.post("/admin/experts/{layer}/{expert}")
    async def swap(layer: int, expert: int, http: HttpRequest):
        _allowed(http)
        decoder = state.engine.decoder
        experts = expert_module(decoder, layer, expert)
        raw = await http.body()
        spec = decoder.spec.layers[layer].ffn.expert
        gate_up, down, digest = await asyncio.get_running_loop().run_in_executor(
            None, parse_expert_file, raw, spec, decoder.dtype, http.headers.get("x-checksum-sha256")
        )
        share = parse_share(http.query_params.get("canary"))
        if is_paged(experts):
            return await _swap_paged(layer, expert, gate_up, down, share, {"sha256": digest})
        # The staging slot: laid out for the kernels here, off the engine thread; switched in below.
        staged = (experts.kernels[0].prepare(gate_up), experts.kernels[1].prepare(down))
        if share is not None and experts.store is not None:
            raise ApiError(409, "a canary is not supported with --expert-parallel yet: swap without ?canary",
                           code="unsupported")
        if share is not None:
            def begin():
                canary = state.scheduler.canary or Canary(share)
                canary.share = share
                canary.experts[(layer, expert)] = (experts, staged)
                state.scheduler.canary = canary
                return state.scheduler.in_flight()

            in_flight = await _switch(begin)
            return JSONResponse({"layer": layer, "expert": expert, "sha256": digest, "swapped": False, "canary": share,
                                 "in_flight": in_flight})

        return await _serve(layer, expert, lambda: replace_expert(experts, expert, staged), {"sha256": digest})

    async def _swap_paged(layer: int, expert: int, gate_up, down, share, reply: dict) -> JSONResponse:
        store = state.scheduler.store
        if share is not None:
            raise ApiError(409, "a canary needs resident experts; this server pages them (--expert-memory): "
                           "swap without ?canary", code="paged_experts")
        if store.substitute:
            raise ApiError(409, f"hot swap of paged experts with --substitute {store.substitute} is not supported "
                           "(the stand-in would keep the old weights)", code="unsupported")
        path = await asyncio.get_running_loop().run_in_executor(None, store.overlay.write, layer, expert, gate_up, down)
        return await _serve(layer, expert, lambda: _point_paged(layer, expert, path), {**reply, "paged": True})

    def _point_paged(layer: int, expert: int, path) -> PagedSource:
        """On the scheduler's thread: the store reads the expert from `path` (None: the checkpoint)."""
        store = state.scheduler.store
        before = store.overlay.point(layer, expert, path)
        store.layers[layer].forget(expert)
        return PagedSource(before)

    async def _serve(layer: int, expert: int, put, reply: dict, before=None) -> JSONResponse:
        """Switch new weights in for every request between two steps (after `before()` there):
        put() does it and returns what it replaced, kept for a rollback."""
        def switch():
            if before is not None:
                before()
            return put(), state.scheduler.in_flight()

        old, in_flight = await _switch(switch)
        depth = swaps.push((layer, expert), old)
        return JSONResponse({"layer": layer, "expert": expert, **reply, "swapped": True, "in_flight": in_flight,
                             "rollbacks": depth})

    def _end_canary(layer: int, expert: int):
        """On the scheduler's thread: the expert leaves the canary (the canary ends with its last)."""
        canary = state.scheduler.canary
        _, staged = canary.experts.pop((layer, expert))
        if not canary.experts:
            state.scheduler.canary = None
        return staged

    def _in_canary(layer: int, expert: int) -> bool:
        canary = state.scheduler.canary
        return canary is not None and (layer, expert) in canary.experts

    @app.post("/admin/experts/{layer}/{expert}/promote")
    async def promote(layer: int, expert: int, http: HttpRequest):
        _allowed(http)
        experts = expert_module(state.engine.decoder, layer, expert)
        if not _in_canary(layer, expert):
            raise ApiError(404, f"expert {expert} of layer {layer} has no canary to promote", code="not_found")
        _, staged = state.scheduler.canary.experts[(layer, expert)]
        return await _serve(layer, expert, lambda: replace_expert(experts, expert, staged), {"promoted": True},
                            before=lambda: _end_canary(layer, expert))

    @app.post("/admin/experts/{layer}/{expert}/rollback")
    async def rollback(layer: int, expert: int, http: HttpRequest):
        _allowed(http)
        experts = expert_module(state.engine.decoder, layer, expert)
        if _in_canary(layer, expert):
            def end():
                _end_canary(layer, expert)
                return state.scheduler.in_flight()

            in_flight = await _switch(end)
            return JSONResponse({"layer": layer, "expert": expert, "rolled_back": True, "canary_ended": True,
                                 "in_flight": in_flight, "rollbacks": swaps.depth((layer, expert))})
        old = swaps.pop((layer, expert))
        if old is None:
            raise ApiError(404, f"expert {expert} of layer {layer} has no swap to roll back", code="not_found")

        def switch():
            if isinstance(old, PagedSource):
                _point_paged(layer, expert, old.path)
            else:
                replace_expert(experts, expert, old)
            return state.scheduler.in_flight()

        in_flight = await _switch(switch)
        return JSONResponse({"layer": layer, "expert": expert, "rolled_back": True, "in_flight": in_flight,
                             "rollbacks": swaps.depth((layer, expert))})
