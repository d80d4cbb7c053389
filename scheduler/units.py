"""Units people write and read: durations ("5m", "1h30m", 300, -1) and byte sizes ("8GiB",
"512MiB", "24GB"). Pure."""

from __future__ import annotations

import math
import re

MIB = 1 << 20
GIB = 1 << 30

_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")


MAX_DURATION_S = 366 * 24 * 3600.0  # longer is a mistake: "forever" is any negative value


def parse_duration_s(value: str | int | float) -> float:
    """Seconds for a duration; negative means "forever" to callers that allow it.

    Accepts numbers (seconds) and Go-style strings as Ollama does ("5m", "1h30m", "-1").
    Raises ValueError naming the value and the accepted forms, also for an infinite or
    NaN value and for one longer than a year.
    """
    seconds = _duration_s(value)
    if not math.isfinite(seconds) or seconds > MAX_DURATION_S:
        raise ValueError(
            f"duration {value!r} is not usable; give at most a year (e.g. '24h'), "
            "or a negative value (-1) for forever"
        )
    return seconds


def _duration_s(value: str | int | float) -> float:
    if isinstance(value, bool):
        raise ValueError(f"duration {value!r} is a boolean; give seconds or a string like '5m'")
    if isinstance(value, int | float):
        return float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    pos, total = 0, 0.0
    for match in _PART.finditer(body):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    if not body or pos != len(body):
        raise ValueError(
            f"duration {value!r} is not valid; use seconds (300, -1) "
            "or units like '5m', '1h30m', '250ms'"
        )
    return sign * total


def format_duration(seconds: float) -> str:
    """Short human form: 'forever', '4m59s', '12s'."""
    if seconds < 0:
        return "forever"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"size {text!r} is not valid; write it like '8GiB', '512MiB' or '24GB'")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def format_bytes(count: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(count) >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} B"
