"""Quiet hours: a daily window in a time zone when nobody is called (pure, no clock of its own).

`QuietHours.parse("21:00-08:00", "Europe/Paris")` is the window from 21:00 to 08:00 the next
morning, local time; a window that does not cross midnight ("12:00-14:00") works too. A
callback due inside the window is scheduled for its end (`QuietHours.end_if_quiet`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, time, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError


def _clock(text: str) -> time:
    hours, sep, minutes = text.strip().partition(":")
    if not sep or not hours.isdigit() or not minutes.isdigit() or len(minutes) != 2:
        raise ValueError(f"{text.strip()!r} is not a time of day such as 21:00")
    h, m = int(hours), int(minutes)
    if not (0 <= h <= 23 and 0 <= m <= 59):
        raise ValueError(f"{text.strip()!r} is not a time of day such as 21:00")
    return time(h, m)


def zone(name: str) -> tzinfo:
    """The time zone `name` (an IANA name such as Europe/Paris, or UTC); ValueError if unknown."""
    try:
        return ZoneInfo(name.strip())
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"unknown time zone {name!r}: use an IANA name such as Europe/Paris"
        ) from None


@dataclass(frozen=True, slots=True)
class QuietHours:
    """From `start` to `end` (local times in `tz`), every day."""

    start: time
    end: time
    tz: tzinfo

    @classmethod
    def parse(cls, window: str, tz_name: str = "UTC") -> QuietHours:
        """`HH:MM-HH:MM` in `tz_name`; ValueError naming what is wrong otherwise."""
        first, sep, second = window.partition("-")
        if not sep:
            raise ValueError(f"quiet hours {window!r} must look like 21:00-08:00")
        start, end = _clock(first), _clock(second)
        if start == end:
            raise ValueError(f"quiet hours {window!r} start and end at the same time")
        return cls(start, end, zone(tz_name))

    def end_if_quiet(self, now: datetime) -> datetime | None:
        """The end of the quiet window `now` falls in (an aware datetime in `now`'s zone),
        or None when `now` is outside it."""
        local = now.astimezone(self.tz)
        at = local.time().replace(second=0, microsecond=0, tzinfo=None)
        wraps = self.start > self.end  # 21:00-08:00 crosses midnight
        inside = (at >= self.start or at < self.end) if wraps else self.start <= at < self.end
        if not inside:
            return None
        day = local.date()
        if at >= self.end:  # the window ends tomorrow (evening part of a wrapping window)
            day += timedelta(days=1)
        end = datetime.combine(day, self.end, tzinfo=self.tz)
        return end.astimezone(now.tzinfo)
