"""The sideband of a GPT-Live session on OpenAI's SIP interconnect, offline: the simulator's
Live conversation (`LiveSimulatedSession`, the same scenarios) with no audio on the socket.

What differs from the primary Live socket:

- The session was configured by the accept (`POST /v1/live/sessions/{id}/accept`), so it is
  started when the sideband attaches; a `session.start` is refused, as is anything outside the
  SDK's sideband union (`openai.types.live.ConnectClientEvent`).
- The trunk carries the audio: the agent's words come as `session.output_transcript.delta`
  whose `start_ms`/`end_ms` span the audio on the session's timeline (real time scaled by
  `realtime_factor`, which is how long the stand-in takes to "play" it), and no audio delta.
- The caller's turns are scripted (`caller_says`; with `auto_caller`, each scripted turn once the
  agent stopped talking, and the hang-up once the script is done): their transcript streams as
  `session.input_transcript.delta`, and speaking over the agent stops it (full duplex).
- A re-attach to the same call goes on with the same conversation; the call's end sends
  `session.closed` (`remote_hangup` when the caller hung up, else `close_requested`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from openai.types.live import OutputTranscriptDeltaEvent
from openai.types.live.connect_server_event import TransportDtmfReceived
from openai.types.live.session_config import SessionConfig
from websockets.exceptions import ConnectionClosed

from telephony.sim.live_session import (
    FIRST_AUDIO_DELAY_S,
    LiveSimulatedSession,
    _tool_names,
    parse_live_client_event,
)
from telephony.sim.scenario import FunctionCallStep, Reply, Scenario

CALLER_PAUSE_S = 0.4  # between the agent's last word and the caller's next turn
CALLER_SPEECH_MS = 900  # how long each simulated caller utterance lasts


class LiveSidebandSession(LiveSimulatedSession):
    """One Live sideband connection of an accepted interconnect call."""

    def __init__(
        self,
        socket: Any,
        scenario: Scenario,
        *,
        session_id: str,
        config: SessionConfig,
        started_at: float,
        previous: LiveSidebandSession | None,
        authorization: str | None,
        realtime_factor: float,
        record: bool,
        auto_caller: bool,
        on_script_done: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(
            socket,
            scenario,
            authorization=authorization,
            realtime_factor=realtime_factor,
            chunk_ms=150,
            synthesize=lambda _ms, _seed, _encoding: b"",  # no audio on a sideband
            record=record,
        )
        self.socket = socket
        self.id = session_id
        self.model = config.model
        self.encoding = "pcmu"  # started: the accept configured it; SIP negotiated the media
        self.delegation = config.delegation.type if config.delegation is not None else "client"
        self.delegation_tools = _tool_names(config.delegation)
        self.initial_input = [item.model_dump(mode="json") for item in config.input or ()]
        resolved = config.model_dump(mode="json", exclude_none=True)
        resolved.update(id=session_id, expires_at=int(time.time()) + 3600, status="active")
        self._resolved = resolved
        self._started_at = started_at  # the session's timeline began at the accept
        self._auto_caller = auto_caller
        self._on_script_done = on_script_done
        self._caller_task: asyncio.Task[None] | None = None
        self.first = previous is None
        if previous is not None:
            # The same session, re-attached: the conversation goes on where it was.
            self._next_step = previous._next_step
            self._cases_taken = previous._cases_taken
            self._latest_output = previous._latest_output
            self._latest_note = previous._latest_note
            self._calls = previous._calls
            self._delegations = previous._delegations
            self.delegation_tools = previous.delegation_tools
            self._resolved = previous._resolved

    async def run(self) -> None:
        greeting = self._scenario.greeting
        if self.first and greeting is not None and not self.initial_input:
            self._speak(greeting, greeting.text, None)
        try:
            await super().run()
        finally:
            task = self._caller_task
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    def _parse(self, data: object) -> Any:
        return parse_live_client_event(data, sideband=True)

    async def end(self, reason: Any) -> None:
        """The call is over on OpenAI's side: `session.closed`, then the socket closes."""
        if self.closed.is_set():
            return
        with contextlib.suppress(ConnectionClosed, ConnectionError, RuntimeError):
            await self._close(reason)
        await self.socket.close(1000)

    # ---- the agent: audio the trunk plays, known here by its transcript's span --------------

    async def _stream_audio(self, reply: Reply, text: str) -> None:
        seconds = reply.duration_ms(text) / 1000 * self._factor
        await asyncio.sleep(FIRST_AUDIO_DELAY_S * self._factor)
        start = self._now_ms()
        await self._send(
            OutputTranscriptDeltaEvent(
                type="session.output_transcript.delta",
                event_id="",
                delta=text,
                start_ms=start,
                end_ms=start + max(1, round(seconds * 1000)),
            )
        )
        await asyncio.sleep(seconds)  # the trunk plays it in (scaled) real time

    async def _say(
        self,
        previous: asyncio.Task[None] | None,
        reply: Reply | None,
        text: str,
        call: FunctionCallStep | None,
    ) -> None:
        await super()._say(previous, reply, text, call)
        if self._auto_caller and self._speaking is asyncio.current_task():
            # The agent stopped talking: the caller takes their turn (once).
            if self._caller_task is None or self._caller_task.done():
                self._caller_task = asyncio.create_task(self._next_caller_turn())

    # ---- the simulated caller -------------------------------------------------------------

    async def caller_says(self, speech_ms: int = CALLER_SPEECH_MS) -> None:
        """The caller speaks one turn (the scenario's next `caller_transcript`); over the
        agent, the agent stops (full duplex)."""
        if self.speaking:
            self.interruptions += 1
            self._stop_speaking()
        await self._caller_turn_started()
        await asyncio.sleep(speech_ms / 1000 * self._factor)
        await self._caller_turn_ended()

    async def press(self, digit: str) -> None:
        """The caller presses a key (RFC 4733 on OpenAI's SIP leg)."""
        await self._send(
            TransportDtmfReceived(type="transport.dtmf.received", event=digit, event_id="")
        )

    async def _next_caller_turn(self) -> None:
        try:
            await asyncio.sleep(CALLER_PAUSE_S * self._factor)
            if self.speaking or self._calls_open():
                return  # the agent goes on first: its end brings us back
            steps = self._scenario.steps
            if self._next_step < len(steps):
                if steps[self._next_step].caller_transcript:
                    await self.caller_says()
                return  # the next step answers a function output or a late result
            if self._on_script_done is not None:
                result = self._on_script_done()
                if asyncio.iscoroutine(result):
                    await result
        except ConnectionClosed:
            pass


__all__ = ["LiveSidebandSession"]
