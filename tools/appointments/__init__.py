"""A second domain, declared entirely in a tools file: appointment booking at a clinic.

`appointments.yaml` is the whole domain as the engine sees it (no Python): its tools, how
to call the clinic's REST API, how to read the answers and how to reconcile a lost one.
`api` is a small stand-in for that API (idempotency keys, a lookup by key and by id, fault
injection), runnable as `python -m tools.appointments`.
"""

from pathlib import Path

TOOLS_FILE = Path(__file__).with_name("appointments.yaml")
