"""`Liveness`: progress is completed steps; idleness and busy-but-stepping loops are healthy."""

from __future__ import annotations

import pytest

from services.common.errors import Unavailable
from services.common.liveness import Liveness


def test_wedged_only_when_work_waits_and_no_step_completes_for_the_bound():
    live = Liveness("the loop", wedged_after_s=10)
    assert live.check(False, now=0) is None
    assert live.check(False, now=1000) is None          # idle for long: healthy
    assert live.check(True, now=1000) is None           # work seen: the clock starts now
    assert live.check(True, now=1009.9) is None         # one step in progress, shorter than the bound
    assert "wedged" in live.check(True, now=1010)       # no step completed for the bound
    live.num_steps += 1
    assert live.check(True, now=1011) is None           # a step completed: healthy again
    for t in range(1012, 1100):                          # busy for minutes, a step every second
        live.num_steps += 1
        assert live.check(True, now=t) is None
    assert live.check(False, now=1100) is None
    assert live.check(True, now=1200) is None           # the idle spell does not count
    assert live.check(True, now=1209) is None


def test_a_dead_loop_names_its_cause():
    live = Liveness("the decoder engine", wedged_after_s=10)
    live.raise_if_dead()
    live.die(KeyError("k"))
    assert live.check(False, now=0) == "the decoder engine stopped: KeyError: 'k'"
    with pytest.raises(Unavailable, match="the decoder engine stopped: KeyError"):
        live.raise_if_dead()


def test_the_bound_must_be_positive():
    with pytest.raises(ValueError, match="wedged_after_s must be > 0 seconds, got 0"):
        Liveness("x", wedged_after_s=0)
