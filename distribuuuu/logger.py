"""Logging for people (console + OUT_DIR/log.txt) and for programs (OUT_DIR/metrics.jsonl).

Only rank 0 talks at INFO level and writes files; other ranks log warnings and errors to stderr,
so a failure on any rank is still seen.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from typing import Any

LOGGER_NAME = "distribuuuu"


def setup_logging(out_dir: str | None, is_main: bool) -> logging.Logger:
    """Configure the "distribuuuu" logger for this process; safe to call again."""
    log = logging.getLogger(LOGGER_NAME)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.propagate = False
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    fmt = logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    console = logging.StreamHandler(sys.stdout if is_main else sys.stderr)
    console.setFormatter(fmt)
    log.addHandler(console)
    if is_main and out_dir:
        os.makedirs(out_dir, exist_ok=True)
        file_handler = logging.FileHandler(os.path.join(out_dir, "log.txt"))
        file_handler.setFormatter(fmt)
        log.addHandler(file_handler)
    return log


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object per line to OUT_DIR/metrics.jsonl (rank 0 only; others no-op)."""

    def __init__(self, out_dir: str, enabled: bool) -> None:
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"
