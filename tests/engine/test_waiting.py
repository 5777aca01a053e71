"""`priority` within a tier: lower is admitted first (vLLM's convention), equal ones in arrival order."""

from __future__ import annotations

from moekit.engine.loader import load_engine
from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.engine.waiting import WaitingQueue


def test_the_queue_orders_by_priority_then_arrival():
    queue = WaitingQueue()
    requests = [Request(prompt=[1], max_new_tokens=1, priority=p) for p in (3, 0, -2, 0, 3)]
    for request in requests:
        queue.append(request)
    order = [requests[i] for i in (2, 1, 3, 0, 4)]
    assert list(queue) == order and queue[0] is order[0] and len(queue) == 5
    assert [queue.popleft() for _ in range(5)] == order
    assert len(queue) == 0


def test_the_scheduler_admits_a_tiers_lowest_priority_first(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("mixtral"), compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=1)  # one row: requests run one after another
    priorities = [5, 0, -1, 0, 10]
    requests = [Request(prompt=[3, 4, 5], max_new_tokens=3, priority=p) for p in priorities]
    outcomes = generate_batch(scheduler, requests)
    admitted = sorted(range(len(requests)), key=lambda i: outcomes[i].admitted_at)
    assert admitted == [2, 1, 3, 0, 4]
    assert len({tuple(o.token_ids) for o in outcomes}) == 1  # order changes nothing a request gets


def test_tiers_still_come_before_priorities(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("mixtral"), compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=1)
    requests = [Request(prompt=[3, 4], max_new_tokens=2, tier="B", priority=-100),
                Request(prompt=[3, 4], max_new_tokens=2, tier="S", priority=100)]
    outcomes = generate_batch(scheduler, requests)
    assert outcomes[1].admitted_at < outcomes[0].admitted_at
