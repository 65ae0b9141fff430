"""Prompt files that cannot be read as files: a FIFO (``open`` blocks until a writer comes, forever), a device
(``/dev/zero`` never ends: reading it grows memory until the process is killed), a socket; and text that does
not fit memory. Each is one ``ValueError`` naming the field, the file and the fix, before anything reads it."""

from __future__ import annotations

import os
import stat

MAX_TEXT_BYTES = 8 << 30  # a JSON-lines prompt table is read whole by the check; beyond this: use parquet
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_regular_file(path: str, where: str) -> None:
    """Raise unless ``path`` is a regular file or a directory (a saved dataset); never opens it."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ValueError(f"{where} cannot be read ({type(e).__name__}: {e})") from None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    raise ValueError(f"{where} is {kind}, not a file; point it at a .jsonl/.parquet file (copy a stream into one "
                     "first)")


def read_jsonl_text(path: str, where: str) -> str:
    """The whole text of a JSON-lines file, UTF-8, refused beyond :data:`MAX_TEXT_BYTES`."""
    check_regular_file(path, where)
    size = os.path.getsize(path)
    if size > MAX_TEXT_BYTES:
        raise ValueError(f"{where} has {size} bytes, more than the {MAX_TEXT_BYTES} a JSON-lines table may have; "
                         "convert it to parquet")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)  # bounded even if the file grows meanwhile
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{where} is not UTF-8 text (byte {data[e.start]:#04x} at line {line}); save it as "
                         "UTF-8") from None
    except OSError as e:
        raise ValueError(f"{where} cannot be read ({type(e).__name__}: {e})") from None
