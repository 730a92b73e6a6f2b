"""`voice-agent replay CALL_ID` as a user runs it: a subprocess on a call recorded on the offline
stack (a booking, confirmed and told, made by `voice-agent eval`). Replayed against the same
code it comes out the same (exit 0) and `--save` writes a scenario that `voice-agent eval`
passes; with the recorded ledger altered (as if the code had decided otherwise then) it comes
out changed (exit 1) and names the first differing decision; an unknown call id is one line,
exit 2. One recorded call serves the module; a test that alters it puts it back."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.cli_support import clean_env, run_cli

# A short booking call (short lines, short audio), so recording and replaying stay quick.
BOOKING = """\
name: a short booking, confirmed and told
provider: {latency_s: 0.2}
model:
  greeting: {text: "Luigi's.", audio_ms: 300}
  steps:
    - caller_transcript: Four at eight.
      function_call:
        name: book_table
        arguments: {date: "{tomorrow}", time: "20:00", party_size: 4, name: Alex}
        preamble: {text: One moment., audio_ms: 300}
    - reply: {text: "{output[readback]}", audio_ms: 600}
    - caller_transcript: "Yes."
      function_call:
        name: confirm_operation
        arguments: {operation_id: "{output[operation_id]}", confirmed: true}
    - reply: {text: "Requested, not confirmed yet.", audio_ms: 400}
    - reply: {text: "{note}", audio_ms: 600}
caller:
  - hear_ms: 300                    # the greeting
  - say: Four at eight.
  - hear: Say yes to confirm        # the readback, heard to its end
  - say: "Yes."
  - wait_operation: committed
  - wait_delivery: heard
  - hangup
expect:
  operations: [committed]
  announced: 1
"""


@pytest.fixture(scope="module")
def recorded_call(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The id of a booking call recorded on the offline stack in the session's database."""
    import asyncio

    work = tmp_path_factory.mktemp("recorded")
    scenario = work / "booking.yaml"
    scenario.write_text(BOOKING)
    before = dt.datetime.now(dt.UTC)
    status, out, err = asyncio.run(
        run_cli("eval", str(scenario), env=clean_env(DATABASE_URL=database_url), cwd=work,
                timeout=90)
    )  # fmt: skip
    assert status == 0, out + err
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT c.id FROM calls c WHERE c.created_at >= %s AND EXISTS "
            "(SELECT 1 FROM operations o WHERE o.call_id = c.id::text) "
            "ORDER BY c.created_at DESC LIMIT 1",
            (before,),
        ).fetchone()
    assert row is not None, "the recorded call has no row"
    yield str(row[0])


async def test_replaying_a_recorded_call_is_the_same_and_saves_a_scenario_eval_passes(
    database_url: str, recorded_call: str, tmp_path: Path
) -> None:
    saved = tmp_path / "scenarios" / "recorded_booking.yaml"
    env = clean_env(DATABASE_URL=database_url)
    status, out, err = await run_cli(
        "replay", recorded_call, "--save", str(saved), env=env, cwd=tmp_path, timeout=90
    )
    assert status == 0, out + err
    lines = out.splitlines()
    assert lines[-1] == "same", out
    assert any(line.split() == ["admission", "1", "book_table", "confirm-needed",
                                "confirm-needed"] for line in lines), out  # fmt: skip
    assert any(
        "operation 1 book_table" in line and line.count("committed") == 2 for line in lines
    ), out
    assert any(line.count("committed by call: heard") == 2 for line in lines), out
    assert "Traceback" not in err

    text = saved.read_text()
    assert f"voice-agent replay {recorded_call}" in text
    assert "operation_id: '{output[operation_id]}'" in text  # the replay names its own
    status, out, err = await run_cli("eval", str(saved), env=env, cwd=tmp_path, timeout=90)
    assert status == 0, out + err
    assert out.startswith(f"PASS replay of call {recorded_call}"), out


async def test_a_changed_decision_exits_1_and_names_the_first_one_that_differs(
    database_url: str, recorded_call: str, tmp_path: Path
) -> None:
    # As if the code of the day had admitted the booking without a readback.
    with psycopg.connect(database_url, autocommit=True) as conn:
        [(row_id, decision)] = conn.execute(
            "SELECT id, decision FROM tool_calls WHERE call_id = %s AND tool = 'book_table'",
            (recorded_call,),
        ).fetchall()
        conn.execute("UPDATE tool_calls SET decision = 'allow' WHERE id = %s", (row_id,))
    try:
        status, out, err = await run_cli(
            "replay", recorded_call, env=clean_env(DATABASE_URL=database_url), cwd=tmp_path,
            timeout=90,
        )  # fmt: skip
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("UPDATE tool_calls SET decision = %s WHERE id = %s", (decision, row_id))
    assert status == 1, out + err
    lines = out.splitlines()
    assert lines[-1] == (
        "changed at decision 1: recorded admission 1 book_table: admit; "
        "replay admission 1 book_table: confirm-needed"
    ), out
    assert any(line.startswith("! admission 1 book_table") for line in lines), out
    # What followed is the same: only the first admission differs.
    assert sum(line.startswith("! ") for line in lines) == 1, out


async def test_an_unknown_call_id_is_one_line_and_exit_2(database_url: str, tmp_path: Path) -> None:
    env = clean_env(DATABASE_URL=database_url)
    unknown = "00000000-0000-4000-8000-000000000000"
    status, out, err = await run_cli("replay", unknown, env=env, cwd=tmp_path, timeout=60)
    assert status == 2, out + err
    assert out == ""
    assert err.strip().splitlines() == [f"voice-agent replay: no call {unknown} in this database"]
