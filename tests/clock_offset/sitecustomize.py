"""Loaded at start-up by a Python process whose PYTHONPATH names this folder (tests run a
worker or placement process so): the process's wall clock, as ``time.time`` and
``time.time_ns`` tell it, is off by ``GGUFQ_TEST_CLOCK_OFFSET_S`` seconds, as a host whose
clock drifted. libfaketime would do it below Python, but under it Python 3.11's sleeps and
timed waits fail or hang."""

import os
import time

_offset_s = float(os.environ.get("GGUFQ_TEST_CLOCK_OFFSET_S", "0"))
if _offset_s:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _offset_s
    time.time_ns = lambda: _time_ns() + int(_offset_s * 1e9)
