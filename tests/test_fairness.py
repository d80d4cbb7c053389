"""Fair order across tenants: the stateful queue (a worker's jobs waiting for a slot, the
simulation's parked jobs) and the stateless order of a parked backlog."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.fairness import FairQueue, fair_order
from workers.engine.batching import Admission


def test_a_tenant_alone_is_fifo_within_a_class_and_interactive_first() -> None:
    q: FairQueue[str] = FairQueue()
    for item, priority in [("b1", "batch"), ("i1", "interactive"), ("b2", "batch")]:
        q.push(item, "a", priority)  # type: ignore[arg-type]
    q.push("i2", "a")
    assert list(q) == ["i1", "i2", "b1", "b2"]  # iterating does not pop
    assert len(q) == 4
    assert [q.pop() for _ in range(4)] == ["i1", "i2", "b1", "b2"]
    with pytest.raises(IndexError):
        q.pop()


def test_a_newcomer_is_served_next_even_behind_a_flood() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(1000):
        q.push(f"h{i}", "heavy", "batch")
    for _ in range(300):
        q.pop()
    q.push("l0", "light", "interactive")
    q.push("l1", "light", "interactive")
    assert [q.pop() for _ in range(4)] == ["l0", "h300", "l1", "h301"]


def test_weights_share_in_proportion() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(300):
        q.push(f"a{i}", "a", weight=3.0)
        q.push(f"b{i}", "b", weight=1.0)
    served = Counter(q.pop()[0] for _ in range(200))
    assert served == {"a": 150, "b": 50}


def test_idle_time_earns_no_credit() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a0", "a")
    assert q.pop() == "a0"  # a is served, then goes quiet while b works alone
    for i in range(50):
        q.push(f"b{i}", "b")
    for _ in range(40):
        q.pop()
    for i in range(1, 20):
        q.push(f"a{i}", "a")
    # a comes back at the current virtual time: it alternates with b, it does not take
    # the next 40 turns that its idle time would have bought
    head = [q.pop()[0] for _ in range(10)]
    assert head.count("a") <= 6 and head.count("b") >= 4


def test_a_tenant_refilling_one_job_at_a_time_gets_no_extra_turns() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(100):
        q.push(f"b{i}", "b")
    served = []
    for i in range(40):
        q.push(f"a{i}", "a")  # a always has exactly one job waiting
        served.append(q.pop()[0])
        served.append(q.pop()[0])
        q.remove_if(lambda item: item.startswith("a"))
    assert served.count("a") <= 41


def test_remove_if_takes_out_matching_items_and_keeps_the_order() -> None:
    q: FairQueue[int] = FairQueue()
    for i in range(10):
        q.push(i, "t" + str(i % 2))
    assert q.remove_if(lambda i: i % 3 == 0) == [0, 6, 3, 9]
    assert len(q) == 6
    assert list(q) == [
        1,
        2,
        5,
        4,
        7,
        8,
    ]  # tenants alternate, the one served longest ago first on a tie
    assert q.remove_if(lambda i: i % 2 == 1) == [1, 5, 7]
    assert [q.pop() for _ in range(3)] == [2, 4, 8]


def test_remove_if_asks_once_per_item() -> None:
    """A cancellation check may change its answer between two calls: each item must end
    up either removed or kept, never both or neither."""
    q: FairQueue[int] = FairQueue()
    for i in range(6):
        q.push(i, "t")
    calls: Counter[int] = Counter()

    def flips(i: int) -> bool:
        calls[i] += 1
        return calls[i] == 1 and i % 2 == 0

    assert q.remove_if(flips) == [0, 2, 4]
    assert list(q) == [1, 3, 5] and len(q) == 3 and set(calls.values()) == {1}


def test_weights_must_be_positive() -> None:
    with pytest.raises(ValueError, match="'x'.*positive"):
        FairQueue[str]().push("j", "x", weight=0)
    with pytest.raises(ValueError, match="positive"):
        fair_order([("x", "batch", 0.0)], {"x": -1})


def test_fair_order_puts_a_lone_job_ahead_of_a_thousand() -> None:
    items = [("A", "batch", float(i)) for i in range(1000)] + [("B", "interactive", 2000.0)]
    order = fair_order(items)
    assert 1000 in order[:2]
    assert sorted(order) == list(range(1001))
    # each tenant keeps interactive first, then arrival order
    mixed = [("A", "batch", 0.0), ("A", "interactive", 5.0), ("A", "batch", 1.0)]
    assert fair_order(mixed) == [1, 0, 2]


def test_fair_order_interleaves_by_weight() -> None:
    items = [("A", "batch", float(i)) for i in range(8)] + [
        ("B", "batch", 100.0 + i) for i in range(8)
    ]
    order = fair_order(items, {"A": 2.0})
    tenants = "".join(items[i][0] for i in order[:9])
    assert tenants.count("A") == 6 and tenants.count("B") == 3


def test_admission_without_classify_is_fifo_and_with_it_fair() -> None:
    plain: Admission[str] = Admission(1)
    for job in ["h1", "h2", "l1"]:
        plain.push(job)
    assert [plain.admit()[0][0]] == ["h1"]
    fair: Admission[str] = Admission(1, classify=lambda j: (j[0], "interactive", 1.0))
    for job in ["h1", "h2", "h3", "l1"]:
        fair.push(job)
    order = []
    while fair.waiting:
        (job, slot), *_ = fair.admit()
        order.append(job)
        fair.release(slot)
    assert order == ["h1", "l1", "h2", "h3"]
    fair.push("x")
    assert fair.take_cancelled(lambda j: j == "x") == ["x"] and not fair.waiting


# -- properties ----------------------------------------------------------------------------

pushes = st.lists(
    st.tuples(
        st.integers(0, 4),  # tenant
        st.sampled_from(["interactive", "batch"]),
        st.integers(1, 30),  # how many jobs it pushes at once
        st.integers(0, 12),  # pops after them
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(pushes, st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=5, max_size=5))
def test_no_tenant_waits_longer_than_the_fair_queueing_bound(
    trace: list[tuple[int, str, int, int]], weights: list[float]
) -> None:
    """From the moment a tenant has a job waiting, it is served within the bound of
    start-time fair queueing: each other tenant i at most ⌊w_i / w_j⌋ + 1 times, so
    (tenants − 1) × (⌊largest weight ratio⌋ + 1) pops; within a tenant and class the
    order is FIFO."""
    q: FairQueue[tuple[int, int, str]] = FairQueue()
    bound = (len(weights) - 1) * (max(weights) // min(weights) + 1)
    waiting_since: dict[int, int] = {}  # tenant → pops since it had a job waiting
    last: dict[tuple[int, str], int] = {}
    seq = 0
    for tenant, priority, burst, pops_after in trace:
        for _ in range(burst):
            q.push((tenant, seq, priority), str(tenant), priority, weights[tenant])  # type: ignore[arg-type]
            seq += 1
        waiting_since.setdefault(tenant, 0)
        for _ in range(pops_after):
            if not q:
                break
            served, at, cls = q.pop()
            assert last.get((served, cls), -1) < at  # FIFO within tenant and class
            last[served, cls] = at
            for t in waiting_since:
                waiting_since[t] += 1
            if not any(item[0] == served for item in q):
                del waiting_since[served]
            else:
                waiting_since[served] = 0
            for t, pops in waiting_since.items():
                assert pops <= bound, (t, pops, weights)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from(["interactive", "batch"]), st.floats(0, 99)),
        min_size=1,
        max_size=120,
    ),
    st.lists(st.sampled_from([1.0, 2.0, 4.0]), min_size=5, max_size=5),
)
def test_fair_order_never_starves_a_tenant(
    raw: list[tuple[int, str, float]], weights: list[float]
) -> None:
    items = [(str(t), p, a) for t, p, a in raw]
    w = {str(i): weight for i, weight in enumerate(weights)}
    order = fair_order(items, w)
    assert sorted(order) == list(range(len(items)))
    present = {t for t, _p, _a in items}
    ratio = max(w[t] for t in present) / min(w[t] for t in present)
    # every tenant's first job within (tenants × weight ratio); between two jobs of one
    # tenant at most that many of the others
    seen: dict[str, int] = {}
    for position, i in enumerate(order):
        tenant = items[i][0]
        gap = position - seen.get(tenant, -1) - 1
        assert gap <= len(present) * ratio, (tenant, gap)
        seen[tenant] = position
    for tenant in present:
        mine = [items[i] for i in order if items[i][0] == tenant]
        ranks = [(p != "interactive", a) for _t, p, a in mine]
        assert ranks == sorted(ranks)


def test_fair_order_with_passes_takes_turns_across_rounds() -> None:
    # placement retries its parked jobs in rounds where one job gets the freed slot: A has
    # a long backlog, B keeps five waiting. Without memory of who was served, B's smaller
    # backlog would win every round and A would starve.
    from scheduler.fairness import FairPasses

    passes, served = FairPasses(), {"a": 0, "b": 0}
    backlog = {"a": 100, "b": 5}
    for _ in range(40):
        items = [(t, "interactive", float(k)) for t, n in backlog.items() for k in range(n)]
        first = items[fair_order(items, passes=passes.ahead())[0]][0]
        served[first] += 1
        passes.served(first)
        if first == "a":
            backlog["a"] -= 1  # b's client keeps five waiting
    assert served == {"a": 20, "b": 20}
    # weights: b of weight 3 gets three turns for a's one
    passes, served = FairPasses(), {"a": 0, "b": 0}
    for _ in range(40):
        items = [(t, "interactive", float(k)) for t in ("a", "b") for k in range(5)]
        first = items[fair_order(items, {"b": 3.0}, passes.ahead())[0]][0]
        served[first] += 1
        passes.served(first, 3.0 if first == "b" else 1.0)
    assert served == {"a": 10, "b": 30}
