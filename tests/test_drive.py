"""drive(engine, prompts, max_new_tokens, ...): the one loop that serves a workload through an engine.

Oracle: each request decoded alone through a ConcatCache (tests/test_serving.py's `expected`); tokens equal,
with no tolerance. Arrival times are checked against the engine's own record of each request's events.
"""

import time

import pytest
from test_serving import expected, prompts

from lab.engine import ServingEngine, drive
from lab.models import InputError, load

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def test_requests_arrive_at_their_step_and_decode_as_alone(tiny):
    ps = prompts((5, 9, 3, 12), seed=11)
    engine = ServingEngine(tiny, 64, page_size=4)
    engine.step()                                        # arrivals count from the call, not from step 0
    seen = []
    rids = drive(engine, ps, [4, 6, 3, 5], arrivals=[0, 3, 3, 7], on_step=lambda e, new: seen.append(new))
    assert [engine.output(r) for r in rids] == expected(tiny, ps, [4, 6, 3, 5])
    assert [engine.requests[r].events["arrived"] for r in rids] == [1, 4, 4, 8]
    assert len(seen) == engine.stats["steps"] - 1 and {r for new in seen for r in new} == set(rids)
    assert len(engine.stats["step_times"]) == engine.stats["steps"]
    assert all(a <= b for a, b in engine.stats["step_times"])


def test_arrivals_in_seconds_wait_for_their_time(tiny):
    ps = prompts((4, 6), seed=12)
    engine = ServingEngine(tiny, 64, page_size=4)
    start = time.perf_counter()
    rids = drive(engine, ps, 3, arrivals=[0, 0.3], in_seconds=True)
    second = engine.requests[rids[1]].events["arrived"]
    assert engine.stats["step_times"][second][0] - start >= 0.3       # not stepped before its time
    assert [engine.output(r) for r in rids] == expected(tiny, ps, 3)


def test_every_prompt_is_checked_before_any_is_added(tiny):
    engine = ServingEngine(tiny, 64, page_size=4)
    with pytest.raises(InputError):
        drive(engine, [[1, 2, 3], [10 ** 6]], 3)
    assert not engine.requests
    with pytest.raises(ValueError, match="arrival"):
        drive(engine, [[1, 2]], 3, arrivals=[1.5])          # a step number is an int
    with pytest.raises(ValueError, match="2 prompts but"):
        drive(engine, [[1, 2], [3]], [3])


def test_max_steps_stops_a_run_that_does_not_finish(tiny):
    engine = ServingEngine(tiny, 64, page_size=4)
    with pytest.raises(RuntimeError, match="did not finish in 3 steps"):
        drive(engine, [[1, 2, 3]], 20, max_steps=3)
    assert engine.stats["steps"] == 3
