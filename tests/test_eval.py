"""`voice-agent eval` as a user runs it: a subprocess on scenario files, over the whole offline
stack (the simulator, the service with its worker, the demo system of record, the fake caller)
on the test database. It passes a scenario that holds, fails one whose expectation is wrong
(naming it, with the actual value), and refuses a malformed file without a traceback."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

from tests.cli_support import ROOT, clean_env, run_cli

SCENARIOS = ROOT / "tests" / "scenarios"


async def test_a_passing_scenario_exits_0_and_writes_a_junit_testcase(
    clean_db: str, tmp_path: Path
) -> None:
    junit = tmp_path / "eval.xml"
    status, out, err = await run_cli(
        "eval", str(SCENARIOS / "booking_confirmed.yaml"), "--junit", str(junit),
        env=clean_env(DATABASE_URL=clean_db), cwd=tmp_path, timeout=90,
    )  # fmt: skip
    assert status == 0, out + err
    assert out.splitlines()[0].startswith("PASS booking confirmed and told once"), out
    assert "operations=['committed'] | bookings=1 | announced=1" in out
    suite = ET.parse(junit).getroot()
    assert suite.tag == "testsuite" and suite.get("tests") == "1" and suite.get("failures") == "0"
    [case] = suite.findall("testcase")
    assert case.get("name") == "booking confirmed and told once"
    assert case.find("failure") is None


async def test_a_wrong_expectation_exits_1_and_names_it_with_the_actual_value(
    clean_db: str, tmp_path: Path
) -> None:
    scenario = yaml.safe_load((SCENARIOS / "barge_in_before_admitted.yaml").read_text())
    scenario["expect"]["bookings"] = 1  # a barge-in before admission books nothing
    scenario["expect"]["never_hears"] = ["take your time"]
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump(scenario))
    junit = tmp_path / "eval.xml"
    status, out, err = await run_cli(
        "eval", str(wrong), "--junit", str(junit),
        env=clean_env(DATABASE_URL=clean_db), cwd=tmp_path, timeout=90,
    )  # fmt: skip
    assert status == 1, out + err
    line = out.splitlines()[0]
    assert line.startswith("FAIL barge-in before admission makes no operation"), out
    assert "expected bookings = 1, got 0" in line
    assert "expected never to hear 'take your time', heard it 1 times" in line
    assert "0 passed, 1 failed" in out
    [failure] = ET.parse(junit).getroot().iter("failure")
    assert "expected bookings = 1, got 0" in (failure.get("message") or "")


async def test_a_malformed_file_is_refused_with_its_line_and_field_and_no_traceback(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\n"
        "model:\n"
        "  steps:\n"
        "    - reply: Hello.\n"
        "caller:\n"
        "  - listen\n"
        "  - shout: hello\n"
        "  - wait_operation: comitted\n"
        "expect:\n"
        "  bookings: many\n"
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    status, out, err = await run_cli(
        "eval", str(bad), str(broken), env=clean_env(), cwd=tmp_path, timeout=30
    )
    assert status == 2, out + err
    assert "Traceback" not in err and out == ""
    lines = err.splitlines()
    assert f"voice-agent eval: {bad}:7: caller[1].shout: Extra inputs are not permitted" in lines
    assert any(
        line.startswith(f"voice-agent eval: {bad}:8: caller[2].wait_operation: ") for line in lines
    )
    assert any(line.startswith(f"voice-agent eval: {bad}:10: expect.bookings: ") for line in lines)
    assert any(line.startswith(f"voice-agent eval: {broken}:2: not YAML") for line in lines), err
