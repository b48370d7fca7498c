"""Files as autoshard writes and checks them: written whole or not at all (to a temporary
name, then renamed), readable like a plainly opened file, identified by their sha256."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autoshard.errors import AutoshardError


def public_mode() -> int:
    """rw-r--r-- under the usual umask: what a plain `open` would give (mkstemp gives 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class FileWriteError(AutoshardError):
    """An output that cannot be written where the user asked."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all; a path that cannot be written (a folder, a
    missing or read-only folder) is a clear error, and leaves nothing behind."""
    if path.is_dir():
        raise FileWriteError(f"cannot write '{path}': it is a directory; name a file in it")
    try:
        handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as error:
        raise FileWriteError(f"cannot write '{path}': {error.strerror}") from None
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        os.chmod(temp, public_mode())
        os.replace(temp, path)
    except BaseException as error:
        Path(temp).unlink(missing_ok=True)
        if isinstance(error, OSError):  # a full disk, a folder that vanished
            raise FileWriteError(f"cannot write '{path}': {error.strerror}") from None
        raise


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


_FLAT_LIST = re.compile(r"\[\s+([^\[\]{}\"]*?)\s+\]")
_LIST_OF_FLAT = re.compile(r"\[\s+((?:\[[^\[\]{}\"]*\],?\s*)+?)\s*\]")


def json_text(data: Mapping[str, Any]) -> str:
    """Indented JSON with lists of numbers, and lists of those, on one line (`[[0, 8], [0, 4]]`)."""
    text = json.dumps(data, indent=1)
    text = _FLAT_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m[1].split(",")) + "]", text)
    text = _LIST_OF_FLAT.sub(lambda m: "[" + re.sub(r"\],\s*\[", "], [", m[1].strip()) + "]", text)
    return text + "\n"
