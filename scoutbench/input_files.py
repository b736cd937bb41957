"""Reading the files scoutbench is given (results, sweep points and manifests, recall profiles, configs): regular
files only (a symlink to one is followed), bounded in size and in JSON nesting, so that a FIFO, a device or a hostile
file named like an input is refused by name with its reason instead of blocking a reader, filling memory or
overflowing the stack. Below everything (methods read their files through it too)."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any


def symlink_problem(path: str | Path) -> str | None:
    """'a symlink loop' or 'a broken symlink (to X)' when `path` or a folder above it is one, else None: the OS
    reports both as "File exists" or "No such file", which names neither the fault nor where it is."""
    current = Path(path)
    for candidate in (current, *current.parents):
        if not os.path.islink(candidate):
            continue
        try:
            os.stat(candidate)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return f"{candidate} is a symlink loop"
            return f"{candidate} is a broken symlink (to {os.readlink(candidate)})"
    return None


# What an input file may be: a result with per-step lists of 10^5 steps is a few MB, and the deepest nesting of any
# kind is under 10 levels. A file beyond either is no input of scoutbench's: refused by name (read whole, a 10 GB file
# would take the machine's memory; parsed, a `[[[[...` of 10^5 levels overflows Python's stack in every reader).
MAX_FILE_BYTES = 64 * 1024**2
MAX_JSON_DEPTH = 64


class UnusableFile(Exception):
    """A file that is not read (not a regular file, too large, not JSON, nested too deep); str() says why."""


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_regular_file(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of `path` when it is a regular file (a symlink to one is followed) of at most `max_bytes`; raises
    UnusableFile otherwise. Opened without blocking and checked on the open descriptor, so a FIFO, a device or a
    file swapped for one after a check is never read (a FIFO blocked every reader; /dev/zero filled memory)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise UnusableFile(f"unreadable ({symlink_problem(path) or exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnusableFile(f"{_file_kind(info.st_mode)}, not a regular file")
        if info.st_size > max_bytes:
            raise UnusableFile(f"{info.st_size} bytes, more than the {max_bytes} bytes an input file may have")
        chunks, size = [], 0
        while size <= max_bytes and (chunk := os.read(fd, min(1 << 20, max_bytes + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:  # it grew while being read
            raise UnusableFile(f"more than the {max_bytes} bytes an input file may have")
        return b"".join(chunks)
    except OSError as exc:
        raise UnusableFile(f"unreadable ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def parse_json_bytes(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON from `data` (UTF-8, a byte-order mark read past), nested at most `max_depth` levels; raises UnusableFile."""
    try:
        parsed = json.loads(data.decode("utf-8-sig"))
    except RecursionError:
        raise UnusableFile(f"nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # bad JSON and non-UTF-8 bytes alike
        raise UnusableFile(f"unreadable ({_first_line(exc)})") from None
    stack = [(parsed, 1)] if isinstance(parsed, (dict, list)) else []
    while stack:  # iteratively: the depth check itself must not recurse
        item, depth = stack.pop()
        if depth > max_depth:
            raise UnusableFile(f"nested deeper than {max_depth} levels")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return parsed


def read_json_file(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """A JSON file as every reader of result folders and input files reads it (`read_regular_file`,
    `parse_json_bytes`)."""
    return parse_json_bytes(read_regular_file(path, max_bytes))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
