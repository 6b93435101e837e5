"""log.txt held back: the lines of a command are kept in memory until its checks have passed."""

from __future__ import annotations

import logging
import os


class HeldFileHandler(logging.Handler):
    """log.txt, whose lines are held in memory until write_held(): a command refused by its checks
    (exit 2) leaves no log.txt, or no appended lines, behind; discard() forgets them."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path, self.held, self.file = path, [], None  # held: records; file: the FileHandler once released

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is not None:
            self.file.emit(record)
        else:
            self.held.append(record)

    def write_held(self) -> None:
        if self.file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self.file = logging.FileHandler(self.path)
            self.file.setFormatter(self.formatter)
        for record in self.held:
            self.file.emit(record)
        self.held = []

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        super().close()
