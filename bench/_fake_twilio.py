"""The fake Twilio REST API in a process of its own, for `bench/delivery.py --worker process`.

Prints `READY <base url>` once listening, then `ARRIVE <To> <t>` for each POST (a message
create) it receives (`t`: its `time.monotonic()` on arrival, the same clock in every process
of this machine), until its standard input closes.

    python bench/_fake_twilio.py [--sms-step-delay-s 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from telephony.sim.fake_twilio_api import FakeTwilioApi


async def main(step_delay_s: float) -> None:
    async with FakeTwilioApi(sms_step_delay_s=step_delay_s) as api:
        print(f"READY {api.base_url}", flush=True)
        loop = asyncio.get_running_loop()
        stdin_closed = loop.run_in_executor(None, sys.stdin.read)
        seen = 0
        while not stdin_closed.done():
            requests = api.requests
            lines = [
                f"ARRIVE {r.form.get('To', '')} {r.t!r}\n"
                for r in requests[seen:]
                if r.method == "POST"
            ]
            seen = len(requests)
            if lines:
                sys.stdout.write("".join(lines))
                sys.stdout.flush()
            await asyncio.sleep(0.002)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sms-step-delay-s", type=float, default=0.01)
    args = parser.parse_args()
    asyncio.run(main(args.sms_step_delay_s))
