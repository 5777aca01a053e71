"""Hot-swapping one expert of a running server: a request in flight gets the old weights up to the
switch and the new ones after it, step by step, and nothing else; a rollback brings the old back."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors.torch import save

from hf_tiny import write_checkpoint
from moekit.engine.loader import load_engine
from moekit.engine.scheduler import Request, Scheduler
from moekit.serve.admin import check_token
from moekit.serve.errors import ApiError

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PROMPT = [5, 17, 42, 9]
NEW = 250
TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("swap"), seed=3)


def _new_expert(engine, seed=0) -> dict[str, torch.Tensor]:
    spec = engine.spec.layers[0].ffn.expert
    gen = torch.Generator().manual_seed(seed)
    f, d = spec.width, spec.hidden_size
    return {
        "gate_proj.weight": torch.randn(f, d, generator=gen) * 0.3,
        "up_proj.weight": torch.randn(f, d, generator=gen) * 0.3,
        "down_proj.weight": torch.randn(d, f, generator=gen) * 0.3,
    }


def _busiest_expert(engine) -> int:
    gen = engine.generate([PROMPT], max_new_tokens=NEW, stop_ids=())
    counts = torch.zeros(engine.decoder.layers[0].ffn.experts.num_experts, dtype=torch.int64)
    for step in gen.routing:
        counts += torch.bincount(step.layers[0].topk_ids.reshape(-1), minlength=counts.numel())
    return int(counts.argmax())


def _expected(folder, expert: int, tensors: dict, switch_at: int) -> list[int]:
    """The request run in-process: old weights until it has `switch_at` tokens, then the new ones."""
    engine = load_engine(folder, compile=False)
    experts = engine.decoder.layers[0].ffn.experts
    scheduler = Scheduler(engine.decoder, max_batch=2)
    tokens: list[int] = []
    scheduler.submit(Request(prompt=PROMPT, max_new_tokens=NEW, on_token=tokens.append))
    while len(tokens) < switch_at:
        scheduler.step()
    assert len(tokens) == switch_at, "the server switched at a token count one step cannot reach"
    gate_up = torch.cat([tensors["gate_proj.weight"], tensors["up_proj.weight"]])
    experts.replace_expert(expert, (experts.kernels[0].prepare(gate_up), experts.kernels[1].prepare(tensors["down_proj.weight"])))
    scheduler.run_until_idle()
    return tokens


def test_a_request_in_flight_gets_old_then_new_weights_per_step(tiny, serve_process):
    engine = load_engine(tiny, compile=False)
    old = engine.generate([PROMPT], max_new_tokens=NEW, stop_ids=()).token_ids[0]
    expert = _busiest_expert(engine)
    tensors = _new_expert(engine)
    server = serve_process("--eager", tiny, "--admin-token", TOKEN)
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        frames = [next(lines) for _ in range(2)]
        swapped = httpx.post(f"{server.url}/admin/experts/0/{expert}", content=save(tensors), headers=AUTH, timeout=TIMEOUT)
        frames += list(lines)
    assert swapped.status_code == 200, swapped.text
    reply = swapped.json()
    assert reply["swapped"] and len(reply["sha256"]) == 64
    got = [json.loads(f[6:])["choices"][0]["token_ids"] for f in frames if f.startswith("data: {")]
    got = [t for ids in got for t in ids]
    assert len(got) == NEW
    if reply["in_flight"]:  # the switch came while the request ran (not after it had ended)
        (switch_at,) = reply["in_flight"]
        assert got == _expected(tiny, expert, tensors, switch_at)
        assert got[:switch_at] == old[:switch_at]
    assert got != old or not reply["in_flight"]

    # A new request sees the new expert throughout; after the rollback, the old one again.
    ask = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    after = httpx.post(server.v1 + "/completions", json=ask, timeout=TIMEOUT).json()["choices"][0]["token_ids"]
    assert after == _expected(tiny, expert, tensors, 0)[:40] and after != old[:40]
    back = httpx.post(f"{server.url}/admin/experts/0/{expert}/rollback", headers=AUTH, timeout=TIMEOUT)
    assert back.status_code == 200 and back.json()["rolled_back"]
    again = httpx.post(server.v1 + "/completions", json=ask, timeout=TIMEOUT).json()["choices"][0]["token_ids"]
    assert again == old[:40]
    twice = httpx.post(f"{server.url}/admin/experts/0/{expert}/rollback", headers=AUTH, timeout=TIMEOUT)
    assert twice.status_code == 404 and "no swap to roll back" in twice.json()["error"]["message"]


def test_only_a_valid_expert_file_with_the_token_is_taken(tiny, serve_process):
    engine = load_engine(tiny, compile=False)
    server = serve_process("--eager", tiny, "--admin-token", TOKEN)
    good = _new_expert(engine)
    url = f"{server.url}/admin/experts/0/1"

    def post(content, headers=AUTH, target=url):
        return httpx.post(target, content=content, headers=headers, timeout=TIMEOUT)

    assert post(save(good), headers={}).status_code == 401
    assert post(save(good), headers={"authorization": "Bearer nope"}).status_code == 403
    cases = [
        (b"not safetensors", 400, "not a safetensors file"),
        (save({**good, "gate_proj.weight": good["gate_proj.weight"][:-1].contiguous()}), 400, "has shape"),
        (save({**good, "up_proj.weight": good["up_proj.weight"].to(torch.int32)}), 400, "must be floating point"),
        (save({**good, "down_proj.weight": good["down_proj.weight"] * float("nan")}), 400, "NaN or infinite"),
        (save({k: v for k, v in good.items() if k != "up_proj.weight"}), 400, "missing ['up_proj.weight']"),
    ]
    for content, status, message in cases:
        r = post(content)
        assert r.status_code == status and message in r.json()["error"]["message"], r.text
    r = post(save(good), headers={**AUTH, "x-checksum-sha256": "0" * 64})
    assert r.status_code == 400 and "sha256" in r.json()["error"]["message"]
    assert post(save(good), target=f"{server.url}/admin/experts/7/1").status_code == 404
    assert post(save(good), target=f"{server.url}/admin/experts/0/99").status_code == 404
    # Nothing above changed the model: its output is the checkpoint's.
    ask = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    assert httpx.post(server.v1 + "/completions", json=ask, timeout=TIMEOUT).json()["choices"][0]["token_ids"] == (
        engine.generate([PROMPT], max_new_tokens=12, stop_ids=()).token_ids[0]
    )


def test_admin_routes_are_off_without_a_configured_token():
    with pytest.raises(ApiError) as err:
        check_token(None, f"Bearer {TOKEN}")
    assert err.value.status == 403 and "--admin-token" in err.value.message
    check_token(TOKEN, f"Bearer {TOKEN}")  # the right token passes


def test_rollbacks_undo_swaps_one_at_a_time_back_to_the_checkpoint(tiny, serve_process):
    engine = load_engine(tiny, compile=False)
    expert = _busiest_expert(engine)
    first, second = _new_expert(engine, seed=1), _new_expert(engine, seed=2)
    server = serve_process("--eager", tiny, "--admin-token", TOKEN)
    ask = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def tokens():
        return httpx.post(server.v1 + "/completions", json=ask, timeout=TIMEOUT).json()["choices"][0]["token_ids"]

    def admin(path, content=None):
        return httpx.post(f"{server.url}/admin/experts/0/{expert}{path}", content=content, headers=AUTH, timeout=TIMEOUT)

    original = tokens()
    assert admin("", save(first)).json()["rollbacks"] == 1
    with_first = tokens()
    assert admin("", save(second)).json()["rollbacks"] == 2
    with_second = tokens()
    assert with_first == _expected(tiny, expert, first, 0)[:30] and with_second == _expected(tiny, expert, second, 0)[:30]
    assert len({tuple(original), tuple(with_first), tuple(with_second)}) == 3
    assert admin("/rollback").json()["rollbacks"] == 1
    assert tokens() == with_first
    assert admin("/rollback").json()["rollbacks"] == 0
    assert tokens() == original
    assert admin("/rollback").status_code == 404


def test_a_canary_serves_its_share_of_new_requests_beside_the_served_weights(tiny, serve_process):
    from concurrent.futures import ThreadPoolExecutor

    engine = load_engine(tiny, compile=False)
    expert = _busiest_expert(engine)
    new = _new_expert(engine, seed=4)
    server = serve_process("--eager", tiny, "--admin-token", TOKEN, "--max-batch", "4")
    ask = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def tokens(headers=None):
        r = httpx.post(server.v1 + "/completions", json=ask, headers=headers or {}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    def admin(path, content=None):
        return httpx.post(f"{server.url}/admin/experts/0/{expert}{path}", content=content, headers=AUTH, timeout=TIMEOUT)

    old = tokens()
    canary_tokens = _expected(tiny, expert, new, 0)[:30]
    assert canary_tokens != old
    started = admin("?canary=0.5", save(new))
    assert started.status_code == 200 and started.json()["canary"] == 0.5 and not started.json()["swapped"]
    # Half of new requests, by a running count: off, on, off, on.
    assert [tokens() for _ in range(4)] == [old, canary_tokens, old, canary_tokens]
    # Both sides in one running batch, each exactly what its weights give alone.
    sides = ["1", "0", "1", "0"]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda side: tokens({"x-moekit-canary": side}), sides))
    assert got == [canary_tokens if side == "1" else old for side in sides]
    bad = httpx.post(server.v1 + "/completions", json=ask, headers={"x-moekit-canary": "yes"}, timeout=TIMEOUT)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-moekit-canary"
    assert admin("?canary=1.5", save(new)).status_code == 400

    promoted = admin("/promote")
    assert promoted.status_code == 200 and promoted.json()["promoted"] and promoted.json()["rollbacks"] == 1
    assert tokens() == canary_tokens and tokens({"x-moekit-canary": "1"}) == canary_tokens  # no canary left: served
    assert admin("/promote").status_code == 404
    assert admin("/rollback").json()["rollbacks"] == 0
    assert tokens() == old

    admin("?canary=0.5", save(new))
    ended = admin("/rollback")  # during a canary: ends it, the served weights unchanged
    assert ended.json()["canary_ended"] and [tokens() for _ in range(2)] == [old, old]


def test_a_paged_expert_swapped_and_rolled_back_gives_the_resident_servers_tokens(tiny, serve_process):
    """--expert-memory: the new weights go to a file of the store's own; the checkpoint is untouched."""
    engine = load_engine(tiny, compile=False)
    expert = _busiest_expert(engine)
    tensors = _new_expert(engine, seed=4)
    before = {p.name: p.read_bytes() for p in sorted(tiny.glob("*.safetensors"))}
    paged = serve_process("--eager", tiny, "--admin-token", TOKEN, "--expert-memory", "75%")  # 6 of 8 slots: paged
    resident = serve_process("--eager", tiny, "--admin-token", TOKEN)
    ask = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def tokens(server):
        return httpx.post(server.v1 + "/completions", json=ask, timeout=TIMEOUT).json()["choices"][0]["token_ids"]

    def admin(server, path="", content=None):
        return httpx.post(f"{server.url}/admin/experts/0/{expert}{path}", content=content, headers=AUTH, timeout=TIMEOUT)

    original = tokens(paged)  # the busiest expert is now resident in the store: the swap must drop it
    assert original == tokens(resident)
    swapped = admin(paged, "", save(tensors))
    assert swapped.status_code == 200, swapped.text
    assert swapped.json()["paged"] and swapped.json()["rollbacks"] == 1
    assert admin(resident, "", save(tensors)).status_code == 200
    after = tokens(paged)
    assert after == tokens(resident) and after != original
    assert admin(paged, "?canary=0.5", save(tensors)).status_code == 409  # a canary needs resident experts
    assert admin(paged, "/rollback").json()["rollbacks"] == 0
    assert tokens(paged) == original
    assert {p.name: p.read_bytes() for p in sorted(tiny.glob("*.safetensors"))} == before
