"""Progress bars for the long commands (`precompile`, `goodput`): tqdm on stderr, only on a terminal.

A bar is a callable `(done, total, name)`, the progress hook the library takes, so the library
itself prints nothing. Redirected to a file or a pipe (as under tests and CI) it draws nothing.
"""

from __future__ import annotations

import sys
from typing import IO, Any


class ProgressBar:
    """`precompile  12/73 [00:04<00:20]  failed-0:3,1:5` on a terminal; silent elsewhere or when `quiet`."""

    def __init__(self, what: str, unit: str, quiet: bool = False, stream: IO[str] | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.what, self.unit = what, unit
        self.shown = not quiet and self.stream.isatty()
        self.bar: Any = None  # made at the first call, when the total is known

    def __call__(self, done: int, total: int, name: str) -> None:
        if not self.shown:
            return
        if self.bar is None:
            from tqdm import tqdm  # imported only when a bar is drawn

            self.bar = tqdm(desc=self.what, unit=self.unit, total=total, file=self.stream, leave=True)
        self.bar.total = total
        self.bar.set_postfix_str(name, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
