"""Files as autoshard writes and checks them: written whole or not at all (to a temporary
name, then renamed), readable like a plainly opened file, identified by their sha256."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def public_mode() -> int:
    """rw-r--r-- under the usual umask: what a plain `open` would give (mkstemp gives 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: Path, data: bytes) -> None:
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        os.chmod(temp, public_mode())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
