"""Numbers the scripts take from the environment (``BENCH_SECONDS=20 make bench``)."""

from __future__ import annotations

import os


def env_number(names: str | tuple[str, ...], default: float) -> float:
    """The first of ``names`` set in the environment to a number, else ``default``."""
    for n in (names,) if isinstance(names, str) else names:
        try:
            return float(os.environ[n])
        except (KeyError, ValueError):
            pass
    return default
