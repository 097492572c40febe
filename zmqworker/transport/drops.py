"""Counting what a socket drops, and saying so at most once a second: a stray peer that
floods a socket with junk must not flood the log too."""

from __future__ import annotations

import logging
import time

LOG_EVERY_S = 1.0


class DropCounter:
    """count(reason) for every message dropped; a WARNING at most every LOG_EVERY_S
    seconds, with the count since the last one and the latest reason."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log = log
        self.what = what
        self.total = 0
        self._unlogged = 0
        self._logged_at = -LOG_EVERY_S

    def count(self, reason: str) -> None:
        self.total += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self.log.warning(
                "dropped %d %s since the last report (%d in all); the latest: %s",
                self._unlogged, self.what, self.total, reason,
            )  # fmt: skip
            self._unlogged = 0
            self._logged_at = now
