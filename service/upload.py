"""The multipart body of POST /v1/plans, streamed: the model file goes to disk chunk by chunk
while it is hashed and counted, so a 2 GiB model never sits in memory, and an upload over the
limit is refused (413) as soon as it crosses it.

Why not FastAPI's `UploadFile`: Starlette reads the whole body into a spooled temporary file
before the route runs, so it can neither enforce the limit while streaming nor hash on the way.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from service.options import MODEL_FIELD, RequestError

FIELD_LIMIT = 1 << 20  # bytes of one non-file form field (annotations are the largest)
DRAIN_LIMIT = 64 << 20  # beyond the limit, bytes still read so the client sees the 413


@dataclass
class Form:
    """A parsed form: its text fields and the model file written to `path`."""

    fields: dict[str, str] = field(default_factory=dict)
    path: Path | None = None
    filename: str = ""
    sha256: str = ""
    size: int = 0


def safe_filename(name: str) -> str:
    """The file name part of an upload's name, reduced to safe characters:
    `../x/My Model.onnx` -> `My_Model.onnx`."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", name.replace("\\", "/").rsplit("/", 1)[-1])
    base = base.lstrip(".")
    return base[:128] or "model.onnx"


class _Parts:
    """python-multipart callbacks: fields kept in memory, the model part written to disk."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.form = Form()
        self.header_name, self.header_value = b"", b""
        self.disposition = b""
        self.name: str | None = None
        self.data = bytearray()
        self.file: BinaryIO | None = None
        self.digest = hashlib.sha256()

    def on_part_begin(self) -> None:
        self.disposition, self.name, self.data = b"", None, bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        if self.header_name.lower() == b"content-disposition":
            self.disposition = self.header_value
        self.header_name, self.header_value = b"", b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.disposition)
        name = options.get(b"name")
        if name is None:
            raise RequestError("a form part has no name (Content-Disposition name=...)", 400)
        self.name = name.decode("utf-8", "replace")
        if self.name == MODEL_FIELD:
            if self.file is not None or self.form.path is not None:
                raise RequestError("the form has more than one 'model' file", 400)
            filename = options.get(b"filename", b"model.onnx").decode("utf-8", "replace")
            self.form.filename = safe_filename(filename)
            # A folder of its own, so the model is checked under its own name.
            self.form.path = self.folder / uuid.uuid4().hex / self.form.filename
            self.form.path.parent.mkdir()
            self.file = open(self.form.path, "wb")  # noqa: SIM115 (closed in on_part_end)

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self.file is None:
            if len(self.data) + len(chunk) > FIELD_LIMIT:
                raise RequestError(
                    f"form field {self.name!r} is larger than {FIELD_LIMIT} bytes", 413
                )
            self.data += chunk
            return
        self.form.size += len(chunk)
        if self.form.size > self.limit:
            raise RequestError(
                f"model upload is larger than the limit of {self.limit} bytes "
                "(the server's --max-upload)",
                413,
            )
        self.digest.update(chunk)
        self.file.write(chunk)

    def on_part_end(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            self.form.sha256 = self.digest.hexdigest()
        elif self.name is not None:
            if self.name in self.form.fields:
                raise RequestError(f"form field {self.name!r} is given twice", 400)
            self.form.fields[self.name] = self.data.decode("utf-8", "replace")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


async def receive_form(
    content_type: str, stream: AsyncIterator[bytes], folder: Path, limit: int
) -> Form:
    """Parse a multipart/form-data body from `stream`; the model part is written under
    `folder` (the caller moves or deletes `form.path`). Raises RequestError with the HTTP
    status: 400 malformed, 413 too large, 415 not multipart."""
    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data":
        raise RequestError(
            "POST /v1/plans takes multipart/form-data (the model file in field 'model')", 415
        )
    boundary = params.get(b"boundary")
    if not boundary:
        raise RequestError("multipart/form-data without a boundary", 400)
    folder.mkdir(parents=True, exist_ok=True)
    parts = _Parts(folder, limit)
    callbacks: Any = {name: getattr(parts, name) for name in dir(parts) if name.startswith("on_")}
    parser = MultipartParser(boundary, callbacks)
    try:
        async for chunk in stream:
            parser.write(chunk)
        parser.finalize()
    except BaseException as error:  # nothing of a refused or broken upload stays on disk
        parts.close()
        discard(parts.form)
        if isinstance(error, FormParserError):
            raise RequestError("malformed multipart/form-data body", 400) from None
        if isinstance(error, RequestError) and error.status == 413:
            await _drain(stream)
        raise
    if parts.form.path is None or not parts.form.sha256:
        discard(parts.form)
        raise RequestError("the form has no 'model' file field (the ONNX model)", 400)
    return parts.form


async def _drain(stream: AsyncIterator[bytes]) -> None:
    """Read (and drop) the rest of a refused body, up to a bound, so that the client, still
    sending, reads the 413 instead of a reset connection."""
    read = 0
    try:
        async for chunk in stream:
            read += len(chunk)
            if read > DRAIN_LIMIT:
                return
    except Exception:  # the client gave up: nothing left to answer
        return


def discard(form: Form) -> None:
    """Delete an upload that was not kept."""
    if form.path is not None:
        form.path.unlink(missing_ok=True)
        form.path.parent.rmdir()
        form.path = None


def keep(form: Form, models: Path) -> Path:
    """Move the uploaded model to `models/<sha256>/<filename>` (kept once per content and
    name); the model's file name is what the plan document records, as the CLI does."""
    assert form.path is not None
    target = models / form.sha256 / form.filename
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        form.path.unlink()
    else:
        os.replace(form.path, target)
    form.path.parent.rmdir()
    form.path = None
    return target
