"""Signs of life through a real TCPStore on loopback: a beating rank is seen, a stopped one is named."""

from __future__ import annotations

import time

from moekit.dist.group import Rank, host_store
from moekit.dist.heartbeat import Beat, Watch, first_silent


def test_the_rank_silent_longest_is_named_once_past_the_threshold():
    assert first_silent({1: 0.2, 2: 5.0, 3: 4.0}, 1.0) == 2
    assert first_silent({1: 0.2, 2: 0.5}, 1.0) is None
    assert first_silent({}, 1.0) is None
    assert first_silent({1: 3.0, 2: 3.0}, 1.0) == 1  # a tie: the lower rank


def test_a_watch_sees_a_beat_and_its_stop():
    timeout_s = 2.0  # a beat every 0.1 s
    store = host_store(3, timeout_s)
    beats = [Beat(Rank(r, 3, 0, store.port), timeout_s).start() for r in (1, 2)]
    watch = Watch(Rank(0, 3, 0, store.port), timeout_s).start()
    try:
        time.sleep(0.6)
        assert max(watch.silent().values()) < 0.5
        beats[1].stop()  # rank 2 stops answering
        time.sleep(1.2)
        silent = watch.silent()
        assert silent[2] > 0.8 and silent[1] < 0.5, silent
        assert first_silent(silent, 0.8) == 2
    finally:
        watch.stop()
        for b in beats:
            b.stop()
