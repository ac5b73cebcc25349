"""How often a live page redraws itself: its base interval, or longer where a redraw takes long.

A fragment with `run_every` asks the server for a redraw every interval whether or not the last
one has finished; Streamlit queues the requests, so on a loaded machine a page whose redraw takes
longer than its interval redraws back to back, never settles and starves every other session.
So a page's interval is its base or twice its last redraw's time on this server, whichever is
longer (the browser's drawing needs time too). The times are kept per page for the whole server:
the next visit of a slow page starts with an interval it can keep.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Iterator

import streamlit as st

LONGEST_S = 30.0  # a live page still redraws at least this often


def refresh_interval(base_s: float, last_redraw_s: float | None) -> float:
    """The base interval, or twice the last redraw rounded up to half seconds, at most LONGEST_S."""
    if last_redraw_s is None:
        return base_s
    return min(LONGEST_S, max(base_s, math.ceil(4 * last_redraw_s) / 2))


@st.cache_resource
def _redraw_seconds() -> dict[str, float]:
    return {}  # one per server: page -> its last redraw's seconds


def last_redraw(page: str) -> float | None:
    """Seconds the page's last redraw on this server took; None before its first."""
    return _redraw_seconds().get(page)


def refresh_every(page: str, base_s: float) -> float:
    return refresh_interval(base_s, last_redraw(page))


@contextmanager
def timed_redraw(page: str) -> Iterator[None]:
    """Times the block (a fragment's body) as the page's last redraw."""
    started = time.monotonic()
    try:
        yield
    finally:
        _redraw_seconds()[page] = time.monotonic() - started
