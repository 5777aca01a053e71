"""The kernel choices persisted beside a build: measured once, by one process at a time."""

from __future__ import annotations

import threading
import time

from moekit.ops.select import read_choices, remembered


def test_two_measuring_at_once_keep_the_first_ones_answer(tmp_path):
    answers, calls = [], []

    def measure(value):
        def run():
            calls.append(value)
            time.sleep(0.2)  # long enough for the other to arrive while this one measures
            return value
        return run

    threads = [threading.Thread(target=lambda v=v: answers.append(remembered("k threads=1", measure(v), tmp_path)))
               for v in ("first", "second")]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(10)
    assert calls == ["first"] and answers == ["first", "first"]
    assert read_choices(tmp_path) == {"k threads=1": "first"}
    assert remembered("k threads=1", measure("third"), tmp_path) == "first" and calls == ["first"]
