"""The `voice-agent` command line: `commands` (the entry point, `main`), `staff` (staff
accounts and API tokens), `banner` (what `serve` prints), the offline demos (`demo` for the
Twilio leg, `demo_openai_sip` for the interconnect) and what they share (`demo_harness`).

The only wing that may import `app.main` and `app.server`.
"""
