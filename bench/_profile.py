"""Summarise a `py-spy record --format raw` profile: where the sampled CPU went.

Usage: python bench/_profile.py PROFILE.txt [--top 25] [--by-module]
Prints the functions with the most samples on top of the stack ("self"), then the share of
samples that pass through each of a few areas of interest ("inclusive").
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

# Areas of the hot path: a sample counts for an area if any frame of its stack matches.
AREAS = {
    "openai SDK event parse (parse_event/construct_type)": r"parse_event|construct_type",
    "openai SDK send path (send/_send/transform)": r"\b_send \(openai|send \(openai/resources"
    r"|_async_transform|async_maybe_transform",
    "pydantic (any)": r"pydantic",
    "permessage-deflate": r"permessage_deflate|PerMessageDeflate",
    "json / orjson": r"\(json/|orjson|\bdumps \(|\bloads \(",
    "base64": r"base64|b64",
    "uvicorn WebSocket protocol": r"uvicorn/protocols/websockets",
    "Starlette WebSocket": r"starlette/websockets",
    "websockets (library)": r"\(websockets/",
    "logging": r"\(logging/",
    "asyncio/uvloop machinery": r"\(asyncio/|uvloop",
    "telephony.bridge": r"\(telephony/bridge",
    "telephony.legs.twilio.leg": r"\(telephony/twilio_leg",
    "telephony.playback": r"\(telephony/playback",
    "app.legs.twilio.routes (FrameGuard)": r"\(app/routes_twilio",
}


def load(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        stacks.append((stack.split(";"), int(count)))
    return stacks


def summarize(path: Path, top: int = 25) -> str:
    stacks = load(path)
    total = sum(c for _, c in stacks) or 1
    leaf: Counter[str] = Counter()
    for frames, count in stacks:
        leaf[frames[-1]] += count
    lines = [f"{path.name}: {total} samples", "", "| self % | function |", "|---|---|"]
    for name, count in leaf.most_common(top):
        lines.append(f"| {count / total * 100:.1f} | `{name}` |")
    lines += ["", "| inclusive % | area |", "|---|---|"]
    for area, pattern in AREAS.items():
        rx = re.compile(pattern)
        hit = sum(c for frames, c in stacks if any(rx.search(f) for f in frames))
        lines.append(f"| {hit / total * 100:.1f} | {area} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print(summarize(args.profile, args.top))
