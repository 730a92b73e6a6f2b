"""Stand-ins for the outside world, shipped as product features: the offline demo and the tests
run on them, and no product module imports them.

- `simulator`: the OpenAI Realtime API (GA events over WebSocket) with a VAD (`vad`: WebRTC's
  where installed, else a level threshold) and scripted conversations (`scenario`,
  `scenarios/`), spoken by a voice (`speech`: eSpeak NG, or Piper) or synthetic tones, the
  caller's turns recognised from their audio (`recognizer`: PocketSphinx) or from the script;
- `fake_caller`: a Twilio caller that places a call through the voice webhook and streams audio
  over a Media Stream, recording what it hears;
- `fake_twilio_api`: the Twilio REST API the service calls (calls, messages).
"""
