"""The races' one line each: a `race` fixture a scenario reports through, and a terminal
summary that prints the lines in the issue's order (also under xdist, as report properties)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

# The order (issue 24, section 1); a scenario not listed prints after these.
ORDER = (
    "barge_in_before_admitted",
    "barge_in_after_running",
    "timeout_after_mutation_sent",
    "duplicate_result",
    "reconnect_while_action_active",
    "handoff_before_async_tool_completes",
    "crash_between_committed_and_ack",
    "late_result_after_intent_change",
    "two_calls_one_resource",
    "retry_with_and_without_provider_idempotency",
    "database_outage_mid_operation",
)
PROPERTY = "race"


@dataclass
class Race:
    """One scenario's outcome, as the suite prints it."""

    name: str
    item: pytest.Item

    def report(self, *, state: str, effects: str, order: str, heard: str) -> str:
        """Record the line (durable state, side effects at the provider, the causal order
        that was checked, what the caller heard); call it after the assertions."""
        line = f"{self.name}: state={state} | effects={effects} | order={order} | heard={heard}"
        self.item.user_properties.append((PROPERTY, line))
        return line


@pytest.fixture
def race(request: pytest.FixtureRequest) -> Race:
    """The race named after the test (`test_<scenario name>`)."""
    name = request.node.originalname.removeprefix("test_")
    return Race(name, request.node)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = [
        value
        for report in terminalreporter.stats.get("passed", [])
        if report.when == "call"
        for key, value in report.user_properties
        if key == PROPERTY
    ]
    if not lines:
        return

    def rank(line: str) -> tuple[int, str]:
        name = line.split(":", 1)[0]
        return (ORDER.index(name) if name in ORDER else len(ORDER), line)

    terminalreporter.section("races")
    for line in sorted(lines, key=rank):
        terminalreporter.write_line(line)
