"""Staff roles: `viewer`, `operator`, `admin`, each including the one before.

A module of its own so that the command line can offer the roles without importing the
accounts (and sqlalchemy's asyncio layer) at every start.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What a staff member (or an API token) may do."""

    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return _RANK[self]

    def allows(self, needed: Role) -> bool:
        """Whether this role includes `needed`."""
        return self.rank >= needed.rank

    @property
    def sees_phone_numbers(self) -> bool:
        return self.allows(Role.OPERATOR)


_RANK = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}
