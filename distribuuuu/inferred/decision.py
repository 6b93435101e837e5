"""One decided value of the config: the key, the value, and where it
came from, shown as a setup line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Decision:
    key: str
    value: Any
    origin: str  # e.g. "from the folder", "config"
    warn: bool = False  # a warning: a value the user set changed, or data too small

    def line(self) -> str:
        return f"{self.key} {self.value} ({self.origin})"
