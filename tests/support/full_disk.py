"""A disk that fills up: for tests that a failed write leaves the old file whole and names the path."""

from __future__ import annotations

import errno
import os


class FullDisk:
    """`os` as one module sees it (`monkeypatch.setattr(module, "os", FullDisk())`), where fsync fails."""

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    @staticmethod
    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
