"""Staff names: the one rule for a console account's name, and the error staff commands raise.

Apart from `app.access.staff` so that settings can check CONSOLE_USER without importing the
accounts (which import the login limits, which are read from settings: an import circle).
"""

from __future__ import annotations

import re

USERNAME = re.compile(r"^[a-z0-9][a-z0-9._@-]{0,47}$")


class StaffError(ValueError):
    """A staff command that cannot be done as asked (the message says why)."""


def check_username(username: str) -> str:
    """The name as stored (lower case), or StaffError."""
    name = username.strip().lower()
    if not USERNAME.match(name):
        raise StaffError(
            "a staff name is 1-48 characters: lower-case letters, digits, and . _ @ - "
            "(starting with a letter or digit)"
        )
    return name
