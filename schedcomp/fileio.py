"""Reading and writing the project's files safely: atomic writes, bounded reads, bounded JSON.

Every file schedcomp writes (plans, caches and their indexes, cost models, traces, checkpoint
manifests) goes through `write_atomic`, so a full disk or a crash leaves the old file whole.
Every file it reads goes through `read_text`/`read_bytes` (a size limit checked before reading,
so `/dev/zero` or a 40 GB file is refused at once) and JSON through `load_json` (a nesting limit
checked before any caller walks the value, so a deeply nested file is one clear error, not a
RecursionError; the size limit already bounds what parsing it can allocate).
Failures raise the caller's `SchedcompError` subclass with one line naming the path.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from schedcomp.errors import SchedcompError

# Generous for every file the project writes (a 100k-worker plan is ~50 MB); a bigger file is
# refused before it is read. Raise it with SCHEDCOMP_MAX_FILE_BYTES.
MAX_FILE_BYTES = 1 << 30
MAX_JSON_DEPTH = 64


def max_file_bytes() -> int:
    raw = os.environ.get("SCHEDCOMP_MAX_FILE_BYTES")
    if raw is None:
        return MAX_FILE_BYTES
    try:
        return int(raw)
    except ValueError:
        raise SchedcompError(f"SCHEDCOMP_MAX_FILE_BYTES={raw!r} is not a whole number of bytes") from None


def write_atomic(path: str | os.PathLike[str], data: str | bytes | Iterable[str],
                 error: type[SchedcompError] = SchedcompError) -> None:
    """Write `data` to `path` via a temporary file in the same directory, fsync, rename; a text may come in
    pieces (`serialize.plan_json_pieces`: a large plan is never held whole).

    On any failure the old file (if any) is left as it was and no temporary file remains.
    """
    path = Path(path)
    payload = data
    try:
        st = os.stat(path)  # follows links: what would be written
    except FileNotFoundError:
        pass
    except OSError as e:
        raise error(f"cannot write {path}: {e.strerror or e}") from None
    else:
        if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
            _write_stream(path, payload, error)  # `-o /dev/null`, `-o /dev/stdout | jq`: nothing to replace
            return
        if not _is_regular(st.st_mode):  # renaming over a directory or socket would replace it: refuse
            raise error(f"cannot write {path}: it is not a regular file; give a file name")
    if path.is_symlink():  # replace the file it points to, not the link
        path = path.resolve()
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise error(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            _write_all(f, payload)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():  # keep the old file's permissions: mkstemp makes it 0600
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        _close(payload)
        raise error(f"cannot write {path}: {e.strerror or e}; the old file, if any, is unchanged") from None
    except BaseException:  # text made in pieces failed half-way (or Ctrl-C): no temporary file remains
        Path(tmp).unlink(missing_ok=True)
        _close(payload)
        raise
    _fsync_dir(path.parent)


def _close(payload: object) -> None:
    """End a generator of pieces left half-way, so what it holds open (a paused collector) is released now,
    not whenever the exception that stopped it is freed."""
    close = getattr(payload, "close", None)
    if callable(close):
        close()


_CHUNK = 1 << 24  # characters encoded at a time


def _write_all(f: BinaryIO, data: str | bytes | bytearray | memoryview | Iterable[str]) -> None:
    """Write `data` to binary file `f`, a string UTF-8 encoded a slice at a time (encoding a 70 MB plan whole
    would hold a second copy of it in memory), pieces one by one."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        f.write(data)
    elif isinstance(data, str):
        for at in range(0, len(data), _CHUNK):
            f.write(data[at : at + _CHUNK].encode())
    else:
        for piece in data:
            f.write(piece.encode())


def _write_stream(path: Path, payload: str | bytes | Iterable[str], error: type[SchedcompError]) -> None:
    """Write to a character device or a FIFO in place. O_NONBLOCK on open: a FIFO nobody reads is
    refused at once (ENXIO) instead of hanging; the writes themselves then block as usual."""
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        reason = "nobody is reading that FIFO" if e.errno == errno.ENXIO else (e.strerror or str(e))
        raise error(f"cannot write {path}: {reason}") from None
    try:
        os.set_blocking(fd, True)
        with os.fdopen(fd, "wb", closefd=True) as f:
            _write_all(f, payload)
    except OSError as e:
        _close(payload)
        raise error(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        _close(payload)
        raise


def read_bytes(path: str | os.PathLike[str], what: str, error: type[SchedcompError] = SchedcompError,
               limit: int | None = None) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (default `max_file_bytes()`)."""
    path = Path(path)
    limit = max_file_bytes() if limit is None else limit
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is then refused as not a regular file).
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not _is_regular(st.st_mode):
                raise error(f"{what} {path} is not a regular file")
            if st.st_size > limit:
                raise error(f"{what} {path} is {st.st_size} bytes, over the limit of {limit} "
                            "(raise it with SCHEDCOMP_MAX_FILE_BYTES)")
            data = f.read(limit + 1)
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:  # a file that grew while we read it
        raise error(f"{what} {path} is over the limit of {limit} bytes (raise it with SCHEDCOMP_MAX_FILE_BYTES)")
    return data


def read_text(path: str | os.PathLike[str], what: str, error: type[SchedcompError] = SchedcompError,
              limit: int | None = None) -> str:
    """A UTF-8 text file, bounded as `read_bytes`."""
    data = read_bytes(path, what, error, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None


def load_json(text: str | bytes, what: str, error: type[SchedcompError] = SchedcompError,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON, refusing nesting deeper than `max_depth`, NaN/Infinity and over-long integers."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{what} is not UTF-8 text (byte {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_int=_bounded_int, parse_float=_finite_float)
    except RecursionError:  # the C parser stops itself ~1000 levels down, having built next to nothing
        raise error(f"{what} nests more than {max_depth} levels deep") from None
    except ValueError as e:  # JSONDecodeError, and our own refusals
        raise error(f"{what} is not valid JSON: {e}") from None
    depth = _nesting(value)
    if depth > max_depth:  # refused before any caller walks it recursively
        raise error(f"{what} nests {depth} levels deep, more than the {max_depth} allowed")
    return value


def dumps_json(value: Any, **kwargs: Any) -> str:
    """JSON that is always valid: NaN and infinities are refused, not written."""
    try:
        return json.dumps(value, allow_nan=False, **kwargs)
    except ValueError as e:
        raise SchedcompError(f"cannot write JSON: {e}") from None



def _nesting(value: Any) -> int:
    """Deepest container nesting of a parsed JSON value, without recursion (only containers are
    pushed, so a 50 MB plan of short strings is walked in a fraction of its parse time)."""
    best, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if type(node) not in (list, dict):
            continue
        best = max(best, depth)
        items = node.values() if type(node) is dict else node
        stack.extend([(v, depth + 1) for v in items if type(v) in (list, dict)])
    return best


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise ValueError(f"number {text[:20]} is too large")
    return value


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > 30:  # far past any count or size we use; int() of 4300 digits raises anyway
        raise ValueError(f"integer with {len(digits)} digits is too large")
    return int(digits)


def _is_regular(mode: int) -> bool:
    return stat.S_ISREG(mode)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is still atomic
    finally:
        os.close(fd)
