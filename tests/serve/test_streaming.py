"""The token stream's hand-off (engine thread → event loop) and its SSE frames (moekit.serve.streaming)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from moekit.serve.streaming import ID_MARK, TEXT_MARK, Dispatcher, Mailbox, cut_template

TEXTS = ["", "a", " the", 'quote " and \\ backslash', "line\nbreak\ttab\r", "\x01\x1f control", "é 漢字 🙂",
         "\u2028\u2029 separators", "</script>", "\x00", "\ud800 a lone surrogate"]


def _completion_chunk(text, ids):
    choice = {"index": 2, "text": text, "logprobs": None, "finish_reason": None}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "cmpl-x", "object": "text_completion", "created": 7, "model": "m", "choices": [choice]}


def _chat_chunk(text, ids):
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [choice]}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"  # the reply's reference frame (app._Reply._frame)


@pytest.mark.parametrize("chunk", [_completion_chunk, _chat_chunk])
@pytest.mark.parametrize("with_ids", [False, True])
def test_a_template_frame_is_the_reference_frame_byte_for_byte(chunk, with_ids):
    template = cut_template(_sse(chunk(TEXT_MARK, [ID_MARK] if with_ids else None)), with_ids)
    assert template is not None
    for token, text in enumerate(TEXTS):
        assert template.frame(text, token * 1000) == _sse(chunk(text, [token * 1000] if with_ids else None))


def test_no_template_where_a_placeholder_is_missing_or_repeated():
    assert cut_template(_sse(_chat_chunk("plain", None)), False) is None
    assert cut_template(_sse({"a": TEXT_MARK, "b": TEXT_MARK}), False) is None
    assert cut_template(_sse(_chat_chunk(TEXT_MARK, None)), True) is None  # no id to put in


def test_every_item_reaches_its_mailbox_in_order_across_threads():
    """An engine-like thread puts into several mailboxes while the loop takes: nothing lost or reordered,
    however the puts and the loop's wakes interleave."""
    boxes, count = 3, 3000

    async def main():
        loop = asyncio.get_running_loop()
        dispatcher = Dispatcher(loop)
        mailboxes = [Mailbox() for _ in range(boxes)]

        def engine():
            for i in range(count):
                for b, box in enumerate(mailboxes):
                    dispatcher.put(box, (b, "token", i))

        async def reader(box):
            got = []
            while len(got) < count:
                got.extend(value for _, _, value in await box.take(loop))
            return got

        thread = threading.Thread(target=engine)
        readers = [asyncio.ensure_future(reader(box)) for box in mailboxes]
        thread.start()
        got = await asyncio.wait_for(asyncio.gather(*readers), timeout=60)
        thread.join()
        return got

    for got in asyncio.run(main()):
        assert got == list(range(count))


def test_an_abandoned_mailbox_hands_on_what_comes_later():
    async def main():
        loop = asyncio.get_running_loop()
        dispatcher = Dispatcher(loop)
        box, handed = Mailbox(), []
        dispatcher.put(box, (0, "token", 1))
        assert box.drain() == [(0, "token", 1)]
        box.abandoned = handed.append
        threading.Thread(target=dispatcher.put, args=(box, (0, "finish", "outcome"))).start()
        for _ in range(200):
            if handed:
                break
            await asyncio.sleep(0.01)
        return handed

    assert asyncio.run(main()) == [(0, "finish", "outcome")]


def _frames(server, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", server.v1 + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    return [event[len("data: "):] for event in text.split("\n\n") if event.startswith("data: ")]


@pytest.mark.parametrize("path, body", [
    ("/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}),
    ("/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "return_token_ids": True, "n": 2}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12,
                           "temperature": 0}),
])
def test_streamed_frames_are_json_dumps_of_what_they_hold_and_add_up_to_the_whole_reply(server, path, body):
    frames = _frames(server, path, {**body, "stream": True})
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(frame) for frame in frames[:-1]]
    for frame, chunk in zip(frames, chunks):
        assert frame == json.dumps(chunk, ensure_ascii=False)  # the template wrote what the reference writes
    whole = httpx.post(server.v1 + path, json=body, timeout=120).json()
    for choice in whole["choices"]:
        parts = [c for chunk in chunks for c in chunk["choices"] if c["index"] == choice["index"]]
        if "message" in choice:
            assert "".join(c["delta"].get("content") or "" for c in parts) == choice["message"]["content"]
        else:
            assert "".join(c["text"] for c in parts) == choice["text"]
            if "token_ids" in choice:
                assert [t for c in parts for t in c.get("token_ids", [])] == choice["token_ids"]
        assert parts[-1]["finish_reason"] == choice["finish_reason"]
