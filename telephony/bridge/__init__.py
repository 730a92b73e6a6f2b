"""The per-call bridge between a phone leg and a speech model, in parts.

Caller audio goes upstream as it arrives; agent audio goes to the leg as it arrives. On top of
the two audio paths sit barge-in (clear, truncate at what was heard, cancel), response
bookkeeping (never a response.create while one is active), function calls handed to the tool
gateway off the audio path, transcripts cut to what was heard, and reconnection within a budget
with an apology when it fails.

```
                           Bridge (bridge.py): state machine, tasks, event routing, the end
                             | hands each part a Port (port.py): emit, spawn, finish, ended
     +-----------+-----------+-----------+----------------+----------------+
     |           |           |           |                |                |
  ModelLink   AudioPath    Turns      Playout         Utterances      ToolDispatch
  (model_     (audio_      (turns.py) (playout.py)    (utterance.py)  (tool_dispatch.py)
   link.py)    path.py)               Local | Server
     |           |  lanes, backlog,   barge-in,       response slot,  function calls ->
  RealtimeLink   |  keypad            items, muted,   queued creates, ToolGateway, caps,
  (realtime_     |                    transcripts,    late results,   outputs back,
   link.py)      |                    apology         announcements   caller evidence
     |           |
  ModelSession: append, truncate, cancel_response, clear_output,
  add_function_output, add_note, create_response (one connection; its ResponseSlot, slot.py)
```

Seams: every part talks to the model through `ModelSession` (a Protocol; `RealtimeSession`
implements it) and never sees the SDK; `ModelLink` connects, reconnects and reads, so a second
model protocol is a second link: GPT-Live is `LiveLink` / `LiveSession` (live_link.py), its
server events routed to the same parts by `LiveEvents` (live_events.py). The variation
between the legs that carry audio (Twilio, our SIP UAS: local playout, truncate at heard
audio) and OpenAI's SIP interconnect (server playout, `output_audio_buffer.clear`) is the
`Playout` strategy, chosen once when the bridge is built. The parts hold no reference to the
bridge: the port is all they can reach.
"""

from telephony.bridge.bridge import Bridge, BridgeState
from telephony.bridge.playout import apology_clip
from telephony.bridge.slot import IllegalTransition
from telephony.session_config import BridgeConfig

__all__ = ["Bridge", "BridgeConfig", "BridgeState", "IllegalTransition", "apology_clip"]
