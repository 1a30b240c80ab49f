"""How the client prints a duration (`status`, `top`, the progress line)."""

from __future__ import annotations


def fmt_duration(seconds: float | None) -> str:
    """H:MM:SS (or M:SS under an hour); '?' when unknown."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    mi, sec = divmod(rest, 60)
    return f"{h}:{mi:02d}:{sec:02d}" if h else f"{mi}:{sec:02d}"
