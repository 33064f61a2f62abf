"""Files in places other users may reach: private folders, atomic writes, bounded reads.

One helper per job, used by the compile cache, the run report and the support matrix:
`private_dir` says why a folder must not be used (another owner, a foreign link, group or
other write); `write_private` replaces a file through a unique temporary in the same folder
(`mkstemp`: new, 0600, never a planted name) and `os.replace` (which replaces a link
planted at the name instead of writing through it); `read_bounded` and `load_json` read
back what the tool wrote, refusing a link, a file over a size limit and JSON nested
deeper than the parser can take (ValueError, which every reader already handles);
`read_input` and `load_input_json` read what a user names (a trace, a config.json) with the
same bounds, never blocking on a FIFO or reading a device without end.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 64 * 2**20  # any report, result table or cache entry the tool writes


def private_dir(path: Path, what: str, create: bool = True) -> str | None:
    """Creates `path` (0700) if missing; returns why it must not be used, or None.

    A folder is usable when the current user owns it (and the link, if it is one) and
    neither group nor others can write it: what is in it may be replaced or executed.
    """
    try:
        if create:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        link = os.lstat(path)
        st = os.stat(path)
    except OSError as err:
        return f"{what} {path} cannot be created or read ({err.strerror})"
    uid = os.getuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid != uid:
        return f"{what} {path} is a symbolic link owned by another user"
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} {path} is not a directory"
    if st.st_uid != uid:
        return f"{what} {path} is owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{what} {path} can be written by other users (mode "
                f"{stat.S_IMODE(st.st_mode):o}); run `chmod go-w {path}`")
    return None


def temp_prefix(path: Path) -> str:
    """The prefix of `write_private`'s temporaries for `path` (to remove crash leftovers)."""
    return f".{path.name}."


def write_private(path: Path, data: bytes | str, mode: int = 0o600) -> None:
    """Replaces `path` atomically with `data` (a new file of `mode`, never written through
    a link or into a file someone else prepared)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
            if mode != 0o600:
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_bounded(path: Path, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of regular file `path`, at most `limit` (ValueError past it; OSError for a
    link or a missing file), checked before anything is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    return _read_regular(fd, limit, f"{path} is not a regular file",
                         lambda size: f"{path} holds {size} bytes, more than the {limit} expected",
                         f"{path} grew past {limit} bytes while it was read")


def _read_regular(fd: int, limit: int, not_regular: str, too_big: Callable[[int], str],
                  grew: str) -> bytes:
    """Reads open `fd` (closing it) if it is a regular file of at most `limit` bytes, checked
    before anything is read and again after (a file can grow while it is read)."""
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(not_regular)
        if st.st_size > limit:
            raise ValueError(too_big(st.st_size))
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(grew)
    return data


def load_json(data: bytes | str) -> Any:
    """json.loads, with nesting too deep for the parser a ValueError like any bad JSON."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def read_json(path: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """`load_json(read_bounded(path, limit))`."""
    return load_json(read_bounded(path, limit))


MAX_INPUT_DEPTH = 64  # nesting of a user's JSON (a config.json nests 3 or 4 deep)


def read_input(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of a file the user named, at most `limit`: a FIFO (which would block), a
    device (/dev/zero never ends) or a folder is refused before anything is read. Every
    problem is a ValueError whose one line names the file and what to give instead."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; give {what}") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}; give {what}") from None
    return _read_regular(fd, limit, f"{path} is not a regular file (a FIFO, a device or a "
                         f"folder); give {what}",
                         lambda _: f"{path} is over {limit / 2**20:g} MiB; give {what} under that",
                         f"{path} grew past {limit / 2**20:g} MiB while it was read")


def check_depth(value: Any, limit: int = MAX_INPUT_DEPTH) -> Any:
    """`value`, when its lists and objects nest at most `limit` deep (ValueError past it:
    code that walks it recursively would hit Python's recursion limit)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                raise ValueError(f"JSON nested more than {limit} deep")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return value


def load_input_json(path: str | Path, limit: int, what: str) -> Any:
    """A user's JSON file, read by `read_input` and checked by `check_depth`."""
    data = read_input(path, limit, what)
    try:
        return check_depth(load_json(data.decode("utf-8")))
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; give {what}") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({str(e)[:120]}); give {what}") from None
