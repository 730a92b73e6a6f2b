"""Where call recordings live: Postgres large objects, or files in a directory.

`RECORDING_STORE=postgres` (the default) keeps each recording as a large object in the
service's own database (no other storage to run or back up); `RECORDING_STORE=file` writes
`<call id>.wav` into `RECORDING_DIR`. Either way `call_recordings` says where a call's recording
is, and reads are by byte range, so the browser's player seeks without downloading it all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls.recording import CONTENT_TYPE, CallRecorder, Recording
from app.console_models import call_recordings_table as recordings_t
from app.settings import Settings
from telephony.legs.leg import AudioFormat
from tools import driver_sql
from tools.autocommit import autocommit

log = logging.getLogger(__name__)

RENDER_TIMEOUT_S = 30.0

# A recording that fits one large-object write, stored with its row in one statement (no
# transaction around it, tools.autocommit): the object, and the row unless the call has one
# already (`call_id` is NULL then, and `new_oid` is the object to unlink).
_PUT_AND_RECORD = sa.text(
    "WITH lo AS (SELECT lo_from_bytea(0, :d) AS oid),"
    " ins AS ("
    " INSERT INTO call_recordings (call_id, store, locator, content_type, bytes, duration_ms,"
    " sample_rate, channels, started_at, truncated)"
    " SELECT :call_id, :store, CAST(lo.oid AS text), :content_type, :bytes, :duration_ms,"
    " :sample_rate, :channels, :started_at, :truncated FROM lo"
    " ON CONFLICT (call_id) DO NOTHING RETURNING *)"
    " SELECT ins.*, lo.oid AS new_oid FROM lo LEFT JOIN ins ON true"
)


class RecordingStore(Protocol):
    """Bytes of recordings, by locator."""

    name: str

    async def put(self, call_id: str, data: bytes | Sequence[bytes]) -> str:
        """Store `data` (one buffer, or pieces stored one after another); returns its
        locator."""
        ...

    async def read(self, locator: str, start: int, length: int) -> bytes: ...

    async def delete(self, locator: str) -> None: ...


class LargeObjectStore:
    """Recordings as Postgres large objects (written in chunks, read by range)."""

    name = "postgres"

    def __init__(self, engine: AsyncEngine, chunk_bytes: int = 1 << 20) -> None:
        self._engine = engine
        self._chunk = chunk_bytes

    def fits_one_statement(self, size: int) -> bool:
        """Whether `size` bytes are written by one `lo_from_bytea` (`Recordings.save` then
        writes the object and its row in one statement)."""
        return size <= self._chunk

    async def put(self, call_id: str, data: bytes | Sequence[bytes]) -> str:
        chunks = _chunks([data] if isinstance(data, bytes) else data, self._chunk)
        async with self._engine.begin() as conn:
            oid = int(
                await conn.scalar(sa.text("SELECT lo_from_bytea(0, :d)"), {"d": next(chunks)})
            )
            offset = 0
            for chunk in chunks:
                offset += self._chunk
                await conn.execute(
                    sa.text("SELECT lo_put(:o, :off, :d)"), {"o": oid, "off": offset, "d": chunk}
                )
        return str(oid)

    async def read(self, locator: str, start: int, length: int) -> bytes:
        async with self._engine.connect() as conn:
            data = await conn.scalar(
                sa.text("SELECT lo_get(:o, :s, :n)"),
                {"o": int(locator), "s": start, "n": length},
            )
        return bytes(data or b"")

    async def delete(self, locator: str) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(sa.text("SELECT lo_unlink(:o)"), {"o": int(locator)})


def _chunks(parts: Sequence[bytes], size: int) -> Iterator[bytes]:
    """`parts`, end to end, in chunks of `size` bytes (the last may be shorter; one empty
    chunk when there is nothing at all)."""
    pending = bytearray()
    sent = False
    for part in parts:
        view = memoryview(part)
        while len(pending) + len(view) >= size:
            take = size - len(pending)
            pending += view[:take]
            view = view[take:]
            yield bytes(pending)
            pending.clear()
            sent = True
        pending += view
    if pending or not sent:
        yield bytes(pending)


class FileStore:
    """Recordings as `<call id>.wav` files in one directory."""

    name = "file"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, locator: str) -> Path:
        path = (self.directory / locator).resolve()
        if path.parent != self.directory.resolve():
            raise ValueError("a locator names a file in the store's directory")
        return path

    async def put(self, call_id: str, data: bytes | Sequence[bytes]) -> str:
        name = f"{uuid.UUID(call_id)}.wav"
        parts = [data] if isinstance(data, bytes) else data

        def write() -> None:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{name}.tmp"
            with tmp.open("wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, self.directory / name)

        await asyncio.to_thread(write)
        return name

    async def read(self, locator: str, start: int, length: int) -> bytes:
        path = self._path(locator)

        def read() -> bytes:
            with path.open("rb") as f:
                f.seek(start)
                return f.read(length)

        return await asyncio.to_thread(read)

    async def delete(self, locator: str) -> None:
        await asyncio.to_thread(self._path(locator).unlink, True)


@dataclass(frozen=True, slots=True)
class RecordingInfo:
    """One row of `call_recordings`."""

    call_id: str
    store: str
    locator: str
    content_type: str
    bytes: int
    duration_ms: int
    sample_rate: int
    channels: int
    started_at: datetime
    truncated: bool

    @classmethod
    def from_row(cls, row: Any) -> RecordingInfo:
        return cls.from_mapping(row._mapping)

    @classmethod
    def from_mapping(cls, m: Any) -> RecordingInfo:
        return cls(
            call_id=str(m["call_id"]),
            store=m["store"],
            locator=m["locator"],
            content_type=m["content_type"],
            bytes=m["bytes"],
            duration_ms=m["duration_ms"],
            sample_rate=m["sample_rate"],
            channels=m["channels"],
            started_at=m["started_at"],
            truncated=m["truncated"],
        )


async def get_recording(engine: AsyncEngine, call_id: str) -> RecordingInfo | None:
    try:
        key = uuid.UUID(call_id)
    except ValueError:
        return None
    async with engine.connect() as conn:
        row = (
            await conn.execute(sa.select(recordings_t).where(recordings_t.c.call_id == key))
        ).first()
    return RecordingInfo.from_row(row) if row is not None else None


class Recordings:
    """This process's recordings: starting a recorder per call, saving it when it ends."""

    def __init__(self, engine: AsyncEngine, settings: Settings) -> None:
        self.engine = engine
        self.enabled = settings.recording_enabled
        self.max_ms = settings.recording_max_s * 1000
        self.stores: dict[str, RecordingStore] = {
            "postgres": LargeObjectStore(engine),
            "file": FileStore(settings.recordings_path()),
        }
        self.store = self.stores[settings.recording_store]

    def start(self, audio_format: AudioFormat) -> CallRecorder | None:
        """A recorder for a call starting now, or None when recording is off."""
        if not self.enabled:
            return None
        return CallRecorder(audio_format, max_ms=self.max_ms)

    async def finish(self, call_id: str, recorder: CallRecorder) -> RecordingInfo | None:
        """Render and store the call's recording; a failure is logged, never raised. The
        recorder's audio (its spool file) is released either way."""
        recorder.seal()  # here, on the thread that records, before the render's thread reads
        try:
            async with asyncio.timeout(RENDER_TIMEOUT_S):
                recording = await asyncio.to_thread(recorder.render)
                return await self.save(call_id, recording)
        except Exception:
            log.exception("the recording of call %s could not be stored", call_id)
            return None
        finally:
            recorder.discard()

    async def save(self, call_id: str, recording: Recording) -> RecordingInfo:
        store = self.store
        if isinstance(store, LargeObjectStore) and store.fits_one_statement(recording.size):
            return await self._save_in_one_statement(call_id, recording, store)
        locator = await store.put(call_id, recording.parts)
        stmt = (
            pg_insert(recordings_t)
            .values(
                call_id=uuid.UUID(call_id),
                store=self.store.name,
                locator=locator,
                content_type=CONTENT_TYPE,
                bytes=recording.size,
                duration_ms=recording.duration_ms,
                sample_rate=recording.sample_rate,
                channels=recording.channels,
                started_at=recording.started_at,
                truncated=recording.truncated,
            )
            .on_conflict_do_nothing(index_elements=["call_id"])
            .returning(*recordings_t.c)
        )
        async with self.engine.begin() as conn:
            row = (await conn.execute(stmt)).first()
        if row is None:
            # The call has a recording already (one media session per call): keep that one.
            await self.store.delete(locator)
            existing = await get_recording(self.engine, call_id)
            assert existing is not None
            return existing
        return RecordingInfo.from_row(row)

    async def _save_in_one_statement(
        self, call_id: str, recording: Recording, store: LargeObjectStore
    ) -> RecordingInfo:
        params = {
            "d": recording.wav,  # one chunk at most: joined here as the chunked path would
            "call_id": uuid.UUID(call_id),
            "store": store.name,
            "content_type": CONTENT_TYPE,
            "bytes": recording.size,
            "duration_ms": recording.duration_ms,
            "sample_rate": recording.sample_rate,
            "channels": recording.channels,
            "started_at": recording.started_at,
            "truncated": recording.truncated,
        }
        # On the driver connection (tools.driver_sql): every recorded call's end runs it.
        async with autocommit(self.engine) as conn:
            (row,) = await driver_sql.fetch(conn, _PUT_AND_RECORD, params)  # always one row
        if row["call_id"] is None:
            # The call has a recording already (one media session per call): keep that one.
            await store.delete(str(row["new_oid"]))
            existing = await get_recording(self.engine, call_id)
            assert existing is not None
            return existing
        return RecordingInfo.from_mapping(row)

    async def read(self, info: RecordingInfo, start: int, length: int) -> bytes:
        store = self.stores.get(info.store)
        if store is None:
            raise LookupError(f"no recording store {info.store!r}")
        return await store.read(info.locator, start, length)
