"""Secrets never reach logs; phone numbers are masked."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import psycopg
import pytest
from pydantic import ValidationError

from app.logging import JsonFormatter, RedactingFilter, redact
from app.settings import Settings
from tools import log_context
from tools.outage import DatabaseHealth, QuietOutageFilter


@pytest.mark.parametrize(
    ("line", "secret"),
    [
        ("Authorization: Bearer sk-live-abcdef0123456789", "sk-live-abcdef0123456789"),
        ("auth_token=9f8e7d6c5b4a", "9f8e7d6c5b4a"),
        ('{"api_key": "sk-proj-XYZ123"}', "sk-proj-XYZ123"),
        ("password=hunter2&user=admin", "hunter2"),
        ("X-Twilio-Signature: signature=abc123def456==", "abc123def456"),
    ],
)
def test_credentials_are_redacted(line: str, secret: str) -> None:
    out = redact(line)
    assert secret not in out
    assert "[redacted]" in out


def test_phone_numbers_keep_only_their_last_two_digits() -> None:
    out = redact("call from +15551234567 to +1 555 000 0042 started")
    assert "5551234567" not in out
    assert "555 000 0042" not in out
    assert "[phone …67]" in out and "[phone …42]" in out


@pytest.mark.parametrize(
    "line",
    [
        "operation 3f2a committed after 2 attempts in 120 ms",
        "GET /availability?date=2026-12-01&time=20%3A00&party_size=4",
        "booking BK7QX2MHN4 at 2026-12-05 21:00 for 4",
        "OPENAI_API_KEY is not set, so calls talk to the local simulator",
    ],
)
def test_ordinary_text_is_left_alone(line: str) -> None:
    assert redact(line) == line


def test_bare_long_digit_runs_are_treated_as_phone_numbers() -> None:
    assert "15551234567" not in redact("caller 15551234567 verified")


def test_filter_redacts_formatted_arguments_of_a_record() -> None:
    logger = logging.getLogger("test.redaction")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    handler.addFilter(RedactingFilter())
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("caller %s sent token=%s", "+15557654321", "tok_SECRET_1")
    finally:
        logger.removeHandler(handler)
    message = records[0].getMessage()
    assert "tok_SECRET_1" not in message
    assert "7654321" not in message


async def test_json_lines_carry_the_call_and_operation_of_the_task_that_wrote_them() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("test.json_lines")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

    async def call_task() -> None:
        log_context.call_id.set("c0ffee00-0000-4000-8000-000000000001")

        async def spawned() -> None:  # a task the call spawns inherits its call
            logger.warning("caller +15551234567 said token=abc123")

        await asyncio.create_task(spawned())

    async def job_task() -> None:
        log_context.operation_id.set("0b5e0000-0000-4000-8000-000000000002")
        try:
            raise RuntimeError("provider said api_key=sk-live-1")
        except RuntimeError:
            logger.exception("job failed")

    try:
        await asyncio.gather(call_task(), job_task())
        logger.info("no call here")
    finally:
        logger.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    by_message = {line["message"]: line for line in lines}
    said = by_message["caller [phone …67] said token=[redacted]"]
    assert said["call_id"] == "c0ffee00-0000-4000-8000-000000000001"
    assert "operation_id" not in said and said["level"] == "WARNING"
    failed = by_message["job failed"]
    assert failed["operation_id"] == "0b5e0000-0000-4000-8000-000000000002"
    assert "call_id" not in failed
    assert "RuntimeError" in failed["exception"] and "sk-live-1" not in failed["exception"]
    assert "call_id" not in by_message["no call here"]
    assert all(
        line["logger"] == "test.json_lines" and line["ts"].endswith("+00:00") for line in lines
    )


def test_log_format_is_text_or_json() -> None:
    assert Settings(log_format="json").log_format == "json"
    with pytest.raises(ValidationError):
        Settings(log_format="xml")


def test_only_the_database_drivers_errors_count_as_a_database_outage() -> None:
    health = DatabaseHealth()
    assert not health.failed("a provider", TimeoutError("no answer"))
    assert not health.failed("an SMS", ConnectionRefusedError("refused"))
    assert not health.down
    gone = psycopg.OperationalError("connection failed: server closed the connection")
    assert health.failed("call heartbeat", gone)
    assert health.down
    health.ok()
    assert not health.down


def test_a_provider_timeout_logged_with_its_traceback_is_kept_not_taken_for_an_outage() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    health = DatabaseHealth()
    handler.addFilter(QuietOutageFilter(health))
    logger = logging.getLogger("test.outage_filter")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise TimeoutError("the provider did not answer")
        except TimeoutError:
            logger.exception("tool call failed")
    finally:
        logger.removeHandler(handler)
    assert "tool call failed" in stream.getvalue()
    assert not health.down
