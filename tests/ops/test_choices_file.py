"""The kernel choices persisted beside a build: measured once, by one process at a time."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from moekit.ops.select import LOADS, Choice, busy, busy_choices, choices_path, forget_choices, pick, read_choices, remembered


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
    assert {k: v for k, v in read_choices(tmp_path).items() if k != LOADS} == {"k threads=1": "first"}
    assert remembered("k threads=1", measure("third"), tmp_path) == "first" and calls == ["first"]


def test_a_measure_that_asks_for_another_choice_does_not_wait_on_its_own_lock(tmp_path):
    # As int8's choose_gemv: its timing runs the q8 operator, which asks for variant("q8_0").
    def outer():
        return "outer+" + remembered("inner threads=1", lambda: "inner", tmp_path)

    answers = []
    measuring = threading.Thread(target=lambda: answers.append(remembered("outer threads=1", outer, tmp_path)), daemon=True)
    measuring.start()
    measuring.join(30)
    assert answers == ["outer+inner"]  # not hung on the lock this thread holds
    assert {k: v for k, v in read_choices(tmp_path).items() if k != LOADS} == {"outer threads=1": "outer+inner",
                                                                            "inner threads=1": "inner"}
    assert set(read_choices(tmp_path)[LOADS]) == {"outer threads=1", "inner threads=1"}


def test_a_choice_keeps_the_load_it_was_measured_at_and_busy_ones_are_named(tmp_path):
    remembered("k threads=1", lambda: "first", tmp_path)
    loads = read_choices(tmp_path)[LOADS]
    assert set(loads) == {"k threads=1"} and loads["k threads=1"] == pytest.approx(os.getloadavg()[0], abs=2)
    assert busy(2.5, 2) and not busy(1.9, 2)
    data = {**read_choices(tmp_path), LOADS: {"k threads=1": 9.5}}
    choices_path(tmp_path).write_text(json.dumps(data))
    assert busy_choices(tmp_path, cpus=2) == {"k threads=1": 9.5} and busy_choices(tmp_path, cpus=16) == {}


def test_forgotten_choices_are_measured_again(tmp_path):
    assert forget_choices(tmp_path) == 0  # nothing measured yet
    remembered("k threads=1", lambda: "first", tmp_path)
    remembered("j threads=1", lambda: "other", tmp_path)
    assert forget_choices(tmp_path) == 2 and read_choices(tmp_path) == {}
    assert remembered("k threads=1", lambda: "second", tmp_path) == "second"
    assert set(read_choices(tmp_path)) == {"k threads=1", LOADS}


def test_fp32_and_q8_keep_the_native_build_unless_another_is_clearly_faster():
    """The probe's medians under load swing by ~10%: fp32 and q8_0 leave the native (AVX-512) build
    only for a clear win, bf16 leaves its pairs kernel only past its own margin."""
    native, native_grouped = Choice("moekit", False), Choice("moekit", True)
    narrow, narrow_grouped = Choice("moekit_avx2", False), Choice("moekit_avx2", True)
    close = {native: 1.06, native_grouped: 1.0, narrow: 0.95, narrow_grouped: 0.97}  # AVX2 5% faster
    assert pick("float32", close, multiplies_bf16=False) == native_grouped
    assert pick("q8_0", close, multiplies_bf16=False) == native_grouped
    clear = {**close, narrow: 0.8}  # AVX2 20% faster (the AMD EPYC's fp32)
    assert pick("float32", clear, multiplies_bf16=False) == narrow
    assert pick("q8_0", clear, multiplies_bf16=False) == narrow
    assert pick("bfloat16", close, multiplies_bf16=True) == native
    assert pick("bfloat16", {**close, narrow: 0.5}, multiplies_bf16=True) == narrow
    assert pick("bfloat16", close, multiplies_bf16=False) == narrow
