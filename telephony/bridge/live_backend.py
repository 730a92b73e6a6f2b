"""GPT-Live client delegation: the deployment's backend agent, run by the service, whose
function calls meet the same engine as every other model's.

With `LIVE_DELEGATION=client` the Live session is started with `delegation: {"type": "client"}`:
when the Live model hands work off it sends only `session.delegation.created` (target `client`,
an id, no task text), and the work is the application's. The service then runs its backend agent
over the Responses API (`LIVE_DELEGATION_MODEL`, at `LIVE_BACKEND_BASE_URL`, which defaults to
OpenAI's; a deployment may point it at its own Responses-compatible agent):

1. one `responses.create` with the call rules as instructions, the conversation so far (the
   bridge's transcript lines as messages), the active agent's catalog tools as function tools,
   and the delegation named in `metadata`;
2. each `function_call` it returns goes to the tool dispatch exactly like a Realtime or a
   Responses-delegation call (identity, policy, confirmation, limits, idempotency, the ledger);
   the engine's answer comes back through `LiveSession.add_function_output` only once the
   engine allows it to be said, and is handed here instead of to the Live socket;
3. with every output in, the next `responses.create` carries them (`previous_response_id`), up to
   `MAX_ROUNDS` rounds; the text it ends with goes to the Live model as the delegation's
   `session.commentary.append`, which the model then tells the caller.

What the caller is told stays true when the backend fails: an error or a timeout before any
function ran is answered "nothing was done"; after one ran, the engine's last output (its own
truthful status) is the commentary. A delegation started on a session that has since been
replaced is answered with `delegation_id: null` (the new session knows no such id).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from openai import AsyncOpenAI

from telephony.bridge.live_items import functions, responses_input
from telephony.call_events import CallEventKind
from telephony.session_config import BridgeConfig, instructions_text

log = logging.getLogger(__name__)

MAX_ROUNDS = 4  # Responses calls per delegation (a function call and its follow-up, twice)
RESPONSES_TIMEOUT_S = 20.0  # one responses.create
OUTPUT_TIMEOUT_S = 120.0  # the engine's answer to one function call (a confirmation waits)
MAX_COMMENTARY_CHARS = 1500  # commentary is limited to 500 tokens
NOTHING_DONE = "That request could not be handled just now; nothing was done."

FunctionCall = Callable[[Any, str, str, str, str, str, str], None]


class ClientBackend:
    """One call's backend agent for client delegations (see the module docstring)."""

    def __init__(
        self,
        port: Any,
        config: BridgeConfig,
        client: AsyncOpenAI,
        tools: Callable[[], list[dict[str, Any]]],
        persona: Callable[[], str | None],
        history: deque[str],
    ) -> None:
        self._port = port
        self._config = config
        self._client = (
            client.with_options(base_url=config.live_backend_base_url)
            if config.live_backend_base_url
            else client
        )
        self._tools = tools
        self._persona = persona
        self._history = history
        self._outputs: dict[str, asyncio.Future[str]] = {}  # call id -> the engine's answer
        self.rounds = 0  # responses.create calls made (for tests and the timeline)
        # The session the call is on now (a reconnect replaces it), from the link.
        self._current: Callable[[], Any] = lambda: None

    def owns(self, call_id: str) -> bool:
        return call_id in self._outputs

    def output(self, call_id: str, output: str) -> bool:
        """The engine's answer to one of our function calls, now allowed to be said."""
        future = self._outputs.get(call_id)
        if future is not None and not future.done():
            future.set_result(output)
        return True

    def delegated(
        self, session: Any, delegation_id: str, response_id: str, function_call: FunctionCall
    ) -> None:
        """A client delegation: work it out in the background, then answer it."""
        self._port.spawn(
            self._run(session, delegation_id, response_id, function_call),
            f"live-backend-{delegation_id}",
        )

    async def _run(
        self, session: Any, delegation_id: str, response_id: str, function_call: FunctionCall
    ) -> None:
        instructions = instructions_text(self._config, persona=self._persona())
        tools = functions(self._tools())
        request_input: list[dict[str, Any]] = responses_input(list(self._history))
        previous: str | None = None
        last_output: str | None = None
        answer = NOTHING_DONE
        try:
            for _ in range(MAX_ROUNDS):
                self.rounds += 1
                async with asyncio.timeout(RESPONSES_TIMEOUT_S):
                    response = await self._client.responses.create(
                        model=self._config.live_delegation_model,
                        instructions=instructions,
                        input=request_input,  # type: ignore[arg-type]
                        tools=tools,  # type: ignore[arg-type]
                        previous_response_id=previous,
                        metadata={"delegation_id": delegation_id, "call_id": self._port.call_id},
                    )
                calls = [item for item in response.output if item.type == "function_call"]
                if not calls:
                    answer = response.output_text or last_output or NOTHING_DONE
                    break
                waiting: list[tuple[str, asyncio.Future[str]]] = []
                for item in calls:
                    future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
                    self._outputs[item.call_id] = future
                    waiting.append((item.call_id, future))
                    function_call(
                        session, item.call_id, item.name, item.arguments,
                        item.id or "", "completed", response_id,
                    )  # fmt: skip
                request_input = []
                for call_id, future in waiting:
                    async with asyncio.timeout(OUTPUT_TIMEOUT_S):
                        last_output = await future
                    request_input.append(
                        {"type": "function_call_output", "call_id": call_id, "output": last_output}
                    )
                previous = response.id
                answer = last_output or answer
        except Exception as exc:  # the backend failed: say only what is known to be true
            log.warning("call %s: client delegation %s failed: %r", self._port.call_id,
                        delegation_id, exc)  # fmt: skip
            self._port.emit(
                CallEventKind.ERROR, where="live:client-delegation", error=repr(exc)[:200]
            )
            answer = last_output or NOTHING_DONE
        await self._answer(session, delegation_id, answer)

    async def _answer(self, session: Any, delegation_id: str, text: str) -> None:
        current = self._current() or session
        same = current is session
        await current.add_commentary(text[:MAX_COMMENTARY_CHARS], delegation_id if same else None)

    def follow(self, current: Callable[[], Any]) -> None:
        self._current = current
