"""Outbound RTP paced by a process of its own (`SIP_PACER=process`, the default).

The clock thread of `rtp.RtpClock` shares the GIL with the event loop that runs the bridges:
whenever the loop holds it (a garbage collection, a burst of JSON), every call's packet waits.
Here the packets leave from a child process with its own interpreter and its own GIL, running
the same `RtpStream` and `RtpClock` code, so their timing is the child's alone.

The parent keeps everything else of the stream (receiving, strict RTP, RTCP, digits in) and
sends the child, over one `AF_UNIX` `SOCK_SEQPACKET` socket, what changes its outbound side:
the RTP socket itself (its descriptor, `SCM_RIGHTS`), where and whether to send, agent audio
(as chunks, each with the playback tracker's offset and epoch), flushes, digits out, close.
The child answers with what it sent: after every tick, for each stream that sent agent audio,
the last frame that left (epoch, item, end offset) and the stream's counters, and every second
the counters of every stream (the parent's RTCP sender reports use them). A flush is a
request: the child drops what has not left and answers with the last frame that did, so the
parent's tracker counts exactly the audio the caller got, as it does with the thread.

If the child dies, its streams go on from the parent's clock thread (`RtpClock`), with what
was queued in the child lost, and an error is logged.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

from telephony.legs.sip.rtp import RtpClock, RtpStream
from telephony.playback import PlaybackTracker

log = logging.getLogger(__name__)

MAX_MESSAGE = 65536
AUDIO_PIECE = 32000  # agent audio is sent in pieces of at most this many bytes (4 s of G.711)
FULL_REPORT_S = 1.0  # every stream's counters, once a second
FLUSH_TIMEOUT_S = 0.5
PRIORITY = -10  # the child's nice value, where it may raise its priority
SWITCH_INTERVAL_S = 0.0005
# The child's command line (not `-m`: what it pickles must name this module, not __main__).
CHILD = "import sys; from telephony.legs.sip.pacer import main; sys.exit(main(sys.argv[1:]))"
SOCKET_BUFFER = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Sent:
    """What the child says of one stream: the last agent frame that left (epoch, item, end
    offset in ms; None if none since the last report) and its counters."""

    slot: int
    last: tuple[int, str, float] | None
    packets_sent: int
    octets_sent: int
    agent_frames_sent: int
    events_sent: int
    seq: int
    ts: int
    queued_frames: int


# ---- the parent's side --------------------------------------------------------------------


class PacerClock(RtpClock):
    """An `RtpClock` whose streams (`PacedStream`) are paced by a child process.

    Streams that never got a socket (unit tests), and every stream once the child is gone,
    are paced by this object's own clock thread, as by a plain `RtpClock`.
    """

    def __init__(self, python: str = sys.executable) -> None:
        super().__init__()
        self._python = python
        self._ctl: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._paced: dict[int, PacedStream] = {}
        self._slots = itertools.count(1)
        self._waiting: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._tokens = itertools.count(1)
        self._dead = False
        self._closing = False

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self._dead

    def start_process(self) -> bool:
        """Start the child now (else with the first stream); False if it cannot run."""
        return self._spawn()

    def _spawn(self) -> bool:
        if self._dead or self._closing:
            return False
        if self._proc is not None:
            return True
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for sock in (ours, theirs):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        try:
            self._proc = subprocess.Popen(
                [self._python, "-c", CHILD, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            log.error("the RTP pacer process could not start (%s): RTP goes from a thread", exc)
            ours.close()
            self._dead = True
            return False
        finally:
            theirs.close()
        self._ctl = ours
        self._reader = threading.Thread(target=self._read, name="rtp-pacer-reader", daemon=True)
        self._reader.start()
        log.info("RTP pacer process %d started", self._proc.pid)
        return True

    def _send(self, message: tuple[Any, ...], fds: tuple[int, ...] = ()) -> bool:
        ctl = self._ctl
        if ctl is None or self._dead:
            return False
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                if fds:
                    socket.send_fds(ctl, [data], list(fds))
                else:
                    ctl.sendall(data)
        except OSError as exc:
            # The reader thread sees the end and moves the streams to the thread (not here:
            # the caller may hold a stream's lock).
            log.warning("RTP pacer: sending to it failed: %s", exc)
            with contextlib.suppress(OSError):
                ctl.shutdown(socket.SHUT_RDWR)
            return False
        return True

    def attach(self, stream: PacedStream, sock: socket.socket, params: dict[str, Any]) -> int:
        """Hand `stream`'s outbound side to the child; its slot, or 0 (paced here)."""
        if not self._spawn():
            return 0
        slot = next(self._slots)
        self._paced[slot] = stream
        if not self._send(("add", slot, params), (sock.fileno(),)):
            self._paced.pop(slot, None)
            return 0
        return slot

    def detach(self, slot: int) -> None:
        if self._paced.pop(slot, None) is not None:
            self._send(("close", slot))

    def command(self, message: tuple[Any, ...]) -> bool:
        return self._send(message)

    def request(self, message: tuple[Any, ...]) -> Sent | None:
        """Send a request (its second field is a token added here) and wait for the answer."""
        token = next(self._tokens)
        done = threading.Event()
        box: list[Any] = []
        self._waiting[token] = (done, box)
        try:
            if not self._send((message[0], token, *message[1:])):
                return None
            if not done.wait(FLUSH_TIMEOUT_S):
                log.warning("the RTP pacer did not answer a %s within %.1f s", message[0],
                            FLUSH_TIMEOUT_S)  # fmt: skip
                return None
            return cast(Sent | None, box[0] if box else None)
        finally:
            self._waiting.pop(token, None)

    def _read(self) -> None:
        ctl = self._ctl
        assert ctl is not None
        while True:
            try:
                data = ctl.recv(MAX_MESSAGE)
            except OSError as exc:
                data = b""
                reason = str(exc)
            else:
                reason = "it exited"
            if not data:
                self._gone(reason)
                return
            try:
                message = pickle.loads(data)
                if message[0] == "sent":
                    self._apply(message[1], message[2])
                elif message[0] == "answer":
                    waiter = self._waiting.get(message[1])
                    if waiter is not None:
                        waiter[1].append(message[2])
                        waiter[0].set()
            except Exception:
                log.exception("RTP pacer: a report could not be read")

    def _apply(self, reports: list[Sent], elapsed_ms: int) -> None:
        for report in reports:
            stream = self._paced.get(report.slot)
            if stream is not None:
                stream.sent(report, elapsed_ms)

    def _gone(self, reason: str) -> None:
        if self._dead:
            return
        self._dead = True
        for _, (done, _box) in list(self._waiting.items()):
            done.set()
        if self._closing:
            return
        code = self._proc.poll() if self._proc is not None else None
        log.error(
            "the RTP pacer process is gone (%s, exit code %s): %d calls' RTP goes on from a "
            "thread, their queued agent audio lost",
            reason, code, len(self._paced),
        )  # fmt: skip
        for stream in list(self._paced.values()):
            stream.paced_here()
        self._paced.clear()

    def close(self) -> None:
        """Stop the child (the listener's stop)."""
        self._closing = True
        ctl, proc = self._ctl, self._proc
        if ctl is not None:
            with contextlib.suppress(OSError):
                ctl.shutdown(socket.SHUT_RDWR)
            ctl.close()
        if proc is not None:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=2)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=2)


class PacedStream(RtpStream):
    """An `RtpStream` whose packets leave from the pacer process once it has a socket."""

    _clock: PacerClock

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slot = 0
        self._queued_there = 0
        self._reported_at = time.monotonic()

    @property
    def remote_paced(self) -> bool:
        """Whether the child sends this stream's packets."""
        return self._slot != 0

    def use_socket(self, sock: socket.socket) -> None:
        super().use_socket(sock)  # RTCP multiplexed on this port is sent from here
        if self._slot or self._closed or not isinstance(self._clock, PacerClock):
            return
        params = {
            "codec": self.codec,
            "dtmf_pt": self.dtmf_pt,
            "ptime_ms": self.ptime_ms,
            "ssrc": self.ssrc,
            "seq": self.seq,
            "ts": self.ts,
        }
        self._slot = self._clock.attach(self, sock, params)
        if self._slot:
            self._media()

    def paced_here(self) -> None:
        """The child is gone: pace from the parent's clock thread from now on."""
        with self.lock:
            self._slot = 0
            started = self._started and not self._closed
            # What the child sent since its last report is not known: sequence and timestamp
            # go on past it (no number twice), as a new talkspurt.
            missed = int((time.monotonic() - self._reported_at) * 1000 // self.ptime_ms) + 1
            self.seq = (self.seq + missed) & 0xFFFF
            self.ts = (self.ts + missed * self.frame_bytes) & 0xFFFFFFFF
            self._marker = True
            self._queued_there = 0
        if started:
            self._clock.add(self)

    def _media(self) -> None:
        """Tell the child where and whether to send (lock held or not needed)."""
        marker, self._marker = self._marker, False
        self._clock.command(("media", self._slot, self.remote, self.sending, marker))

    def set_remote(self, remote: Any, direction: Any) -> None:
        super().set_remote(remote, direction)
        if self._slot:
            with self.lock:
                self._media()

    def _learn(self, addr: tuple[Any, ...], source: tuple[str, int]) -> None:
        super()._learn(addr, source)
        if self._slot:
            with self.lock:
                self._media()

    def start(self) -> None:
        if not self._slot:
            super().start()
            return
        if not self._started and not self._closed:
            self._started = True
            if self._source is None:
                self._learn_until = time.monotonic() + self._policy.learn_s
            self._clock.command(("start", self._slot))

    def enqueue(self, item_id: str, audio: bytes) -> None:
        if not self._slot:
            super().enqueue(item_id, audio)
            return
        with self.lock:
            if self._closed:
                return
            for offset in range(0, len(audio), AUDIO_PIECE):
                piece = audio[offset : offset + AUDIO_PIECE]
                epoch, end_ms = self.playback.queued(item_id, len(piece) / 8)
                self._queued_there += -(-len(piece) // self.frame_bytes)
                self._clock.command(
                    ("audio", self._slot, epoch, item_id, end_ms - len(piece) / 8, piece)
                )

    def flush(self, then: Callable[[], None] | None = None) -> int:
        if not self._slot:
            return super().flush(then)
        answer = self._clock.request(("flush", self._slot))
        with self.lock:
            dropped = 0
            if answer is not None:
                dropped = answer.queued_frames
                self._take(answer)
            self._queued_there = 0
            if then is not None:
                then()
            return dropped

    @property
    def queued_frames(self) -> int:
        return self._queued_there if self._slot else len(self._queue)

    def send_events(self, keys: list[tuple[int, int, int]]) -> None:
        if not self._slot:
            super().send_events(keys)
            return
        self._clock.command(("digits", self._slot, keys))

    def sent(self, report: Sent, elapsed_ms: int) -> None:
        """A report from the child (its reader thread); `elapsed_ms` since the last full one
        (0: this one has only the streams that sent agent audio)."""
        with self.lock:
            if self._closed:
                return
            self._take(report)
            if elapsed_ms:
                # RTCP from here, on the child's counters, at the randomized interval (counted
                # in our packets, as the clock thread counts it).
                self._rtcp_due -= max(1, elapsed_ms // self.ptime_ms)
                if self._rtcp_due <= 0:
                    self._rtcp_due = self._next_rtcp_due()
                    self._send_rtcp()

    def _take(self, report: Sent) -> None:
        self.packets_sent = report.packets_sent
        self.octets_sent = report.octets_sent
        self.agent_frames_sent = report.agent_frames_sent
        self.events_sent = report.events_sent
        self.seq = report.seq
        self.ts = report.ts
        self._reported_at = time.monotonic()
        self._queued_there = report.queued_frames
        if report.last is not None:
            epoch, item_id, end_ms = report.last
            self.playback.played(epoch, item_id, end_ms)

    def close(self) -> None:
        slot = self._slot
        super().close()
        if slot:
            self._clock.detach(slot)


# ---- the child's side ---------------------------------------------------------------------


class _Heard:
    """The child's stand-in for a playback tracker: the offsets the parent gave each chunk,
    and the last frame that left."""

    def __init__(self, slot: int, dirty: set[int]) -> None:
        self.slot = slot
        self.epoch = 0
        self.offsets: dict[str, float] = {}
        self.last: tuple[int, str, float] | None = None
        self._dirty = dirty

    def queued(self, item_id: str, ms: float) -> tuple[int, float]:
        end = self.offsets.get(item_id, 0.0) + ms
        self.offsets[item_id] = end
        return self.epoch, end

    def played(self, epoch: int, item_id: str, upto_ms: float) -> bool:
        self.last = (epoch, item_id, upto_ms)
        self._dirty.add(self.slot)
        return True

    def chunk(self, epoch: int, item_id: str, start_ms: float, tail: bytes, tail_item: str | None
              ) -> None:  # fmt: skip
        """A chunk of `item_id` starting at `start_ms` (the parent's offset) comes; audio of
        the same item still waiting to fill a frame comes before it."""
        self.epoch = epoch
        if len(self.offsets) > 16:
            for key in list(self.offsets)[:8]:
                del self.offsets[key]
        held = len(tail) / 8 if tail_item == item_id else 0.0
        self.offsets[item_id] = start_ms - held


class _Child:
    def __init__(self, ctl: socket.socket) -> None:
        self.ctl = ctl
        self.streams: dict[int, tuple[RtpStream, _Heard]] = {}
        self.dirty: set[int] = set()
        self.pending: dict[int, Sent] = {}
        self.last_full = time.monotonic()
        self.clock = RtpClock(after_tick=self.report)
        self.lock = threading.Lock()

    def sent(self, slot: int, stream: RtpStream, heard: _Heard) -> Sent:
        last, heard.last = heard.last, None
        return Sent(slot, last, stream.packets_sent, stream.octets_sent, stream.agent_frames_sent,
                    stream.events_sent, stream.seq, stream.ts, stream.queued_frames)  # fmt: skip

    def report(self) -> None:
        """After each tick (the clock thread): what left, for the parent."""
        now = time.monotonic()
        elapsed_ms = 0
        if now - self.last_full >= FULL_REPORT_S:
            elapsed_ms = round((now - self.last_full) * 1000)
            self.last_full = now
        with self.lock:
            slots = list(self.streams) if elapsed_ms else list(self.dirty)
            self.dirty.clear()
            for slot in slots:
                entry = self.streams.get(slot)
                if entry is None:
                    continue
                sent = self.sent(slot, *entry)
                before = self.pending.get(slot)
                if sent.last is None and before is not None and before.last is not None:
                    sent = replace(sent, last=before.last)  # not yet told: keep it
                self.pending[slot] = sent
            if not self.pending:
                return
            message = pickle.dumps(
                ("sent", list(self.pending.values()), elapsed_ms), pickle.HIGHEST_PROTOCOL
            )
            try:
                self.ctl.send(message, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return  # the parent is behind: sent with the next tick's
            except OSError:
                os._exit(0)  # the parent is gone
            self.pending.clear()

    def handle(self, message: tuple[Any, ...], fds: list[int]) -> None:
        kind = message[0]
        if kind == "add":
            _, slot, params = message
            heard = _Heard(slot, self.dirty)
            stream = RtpStream(
                params["codec"], params["dtmf_pt"], cast(PlaybackTracker, heard), self.clock,
                lambda _a, _t: None, lambda _d: None, ptime_ms=params["ptime_ms"],
            )  # fmt: skip
            stream.ssrc, stream.seq, stream.ts = params["ssrc"], params["seq"], params["ts"]
            sock = socket.socket(fileno=fds[0])
            stream.use_socket(sock)
            stream.transport = cast(Any, _Closer(sock))
            with self.lock:
                self.streams[slot] = (stream, heard)
            return
        for fd in fds:
            os.close(fd)
        entry = self.streams.get(message[2] if kind == "flush" else message[1])
        if entry is None:
            if kind == "flush":
                self.answer(message[1], None)
            return
        stream, heard = entry
        if kind == "media":
            _, _, remote, sending, marker = message
            with stream.lock:
                stream.remote = remote
                stream.sending = sending
                if marker:
                    stream._marker = True
        elif kind == "start":
            stream.start()
        elif kind == "audio":
            _, _, epoch, item_id, start_ms, audio = message
            with stream.lock:
                heard.chunk(epoch, item_id, start_ms, stream._tail, stream._tail_item)
                stream._enqueue(item_id, audio)
        elif kind == "flush":
            _, token, slot = message
            told: list[Sent] = []

            def last_sent() -> None:  # under the stream's lock, as the queue is dropped
                with self.lock:
                    self.dirty.discard(slot)
                    self.pending.pop(slot, None)
                told.append(self.sent(slot, stream, heard))

            dropped = stream.flush(then=last_sent)
            self.answer(token, replace(told[0], queued_frames=dropped))
        elif kind == "digits":
            stream.send_events(message[2])
        elif kind == "close":
            with self.lock:
                self.streams.pop(message[1], None)
                self.pending.pop(message[1], None)
            stream.close()

    def answer(self, token: int, sent: Sent | None) -> None:
        try:
            self.ctl.sendall(pickle.dumps(("answer", token, sent), pickle.HIGHEST_PROTOCOL))
        except OSError:
            os._exit(0)

    def run(self) -> None:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.ctl, MAX_MESSAGE, 4)
            except OSError:
                return
            if not data:
                return  # the parent closed its end or exited
            try:
                self.handle(pickle.loads(data), fds)
            except Exception as exc:  # no logging is set up here: one line, no traceback
                print(f"rtp pacer: a command failed: {exc!r}", file=sys.stderr)


class _Closer:
    """What `RtpStream.close` closes in the child: its copy of the RTP socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def close(self) -> None:
        self._sock.close()


def main(argv: list[str]) -> int:
    # The parent decides when we stop (it closes its end, or exits): a Ctrl+C or a SIGTERM to
    # the whole group must not end the calls' audio while the parent drains them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Ahead of the bridges when the machine is busy, where the process may (CAP_SYS_NICE, or
    # root): a packet late by a scheduling slice is heard; a bridge late by one is not.
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, 0, PRIORITY)
    # The thread reading commands (agent audio comes in bursts) hands the GIL to the clock
    # thread within this, not the default 5 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    ctl = socket.socket(fileno=int(argv[0]))
    ctl.setblocking(True)

    gc.freeze()  # what was imported is never garbage: young collections stay small
    _Child(ctl).run()
    return 0
