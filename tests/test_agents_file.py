"""Agents files (AGENTS_FILE): checked against the catalog at start, refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from telephony.sim.scenario import load_scenario
from tests.cli_support import clean_env, error_lines, run_cli
from tools.agents import AgentsFileError, load_agents_file, load_agents_text
from tools.restaurant import plugin

NO_DATABASE = "postgresql://nobody@127.0.0.1:9/none"
AGENTS = Path(plugin.__file__).with_name("agents.yaml")
TOOLS = ["check_availability", "book_table", "cancel_booking", "get_booking", "confirm_operation"]

GOOD = """\
agents:
  - name: host
    instructions: You are the host.
    tools: [check_availability, book_table]
    handoffs: [manager]
  - name: manager
    instructions: You are the manager.
    tools: [cancel_booking]
    disclose: [cancel_booking]
"""


def test_the_restaurant_agents_file_declares_a_host_who_hands_off_to_a_manager() -> None:
    agents = load_agents_file(AGENTS, TOOLS)
    assert agents.start == "host"
    assert agents.get(None).handoffs == ("manager",)
    assert "cancel_booking" in agents.get("manager").tools
    assert "cancel_booking" not in agents.get("host").tools


def test_disclosure_is_every_tool_unless_the_agent_names_its_own() -> None:
    agents = load_agents_text(GOOD, TOOLS, source="a.yaml")
    assert agents.may_disclose("host", "book_table")
    assert agents.may_disclose("manager", "cancel_booking")
    assert not agents.may_disclose("manager", "book_table")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD.replace("[cancel_booking]\n    disclose", "[refund]\n    disclose"),
         "a.yaml:8: agents[1].tools[0]: no tool 'refund' in the catalog. Fix: name one of"),
        (GOOD.replace("handoffs: [manager]", "handoffs: [cashier]"),
         "a.yaml:5: agents[0].handoffs[0]: no other agent named 'cashier'. Fix: hand off to "
         "one of manager"),
        (GOOD.replace("name: manager", "name: host"),
         "a.yaml:6: agents[1].name: duplicate agent name 'host' (also agents[0]). Fix: give"),
        ("agents: []\n", "a.yaml:1: agents: no agents. Fix: declare one at least"),
        (GOOD + "start: chef\n", "a.yaml:10: start: no agent named 'chef'. Fix: start with"),
        ("agents: [\n", "a.yaml:"),
    ],
    ids=["unknown-tool", "unknown-target", "duplicate", "none", "bad-start", "not-yaml"],
)  # fmt: skip
def test_a_bad_agents_file_is_one_line_naming_file_problem_and_fix(
    text: str, expected: str
) -> None:
    with pytest.raises(AgentsFileError) as exc:
        load_agents_text(text, TOOLS, source="a.yaml")
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("AGENTS_FILE " + expected), message


async def test_serve_refuses_an_agents_file_naming_an_unknown_tool(tmp_path: Path) -> None:
    path = tmp_path / "agents.yaml"
    path.write_text(GOOD.replace("tools: [cancel_booking]", "tools: [refund]"))
    env = clean_env(DATABASE_URL=NO_DATABASE, AGENTS_FILE=str(path))
    code, _, err = await run_cli("serve", env=env, cwd=tmp_path)
    assert code == 2, err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"voice-agent serve: AGENTS_FILE {path}:8: "), lines[0]
    assert "no tool 'refund' in the catalog. Fix: name one of" in lines[0]


def test_the_handoff_scenario_hands_the_host_to_an_agent_the_file_allows() -> None:
    scenarios = Path(load_scenario.__code__.co_filename).with_name("scenarios")
    scenario = load_scenario(scenarios / "restaurant-handoff.json")
    agents = load_agents_file(AGENTS, TOOLS)
    calls = [s.function_call for s in scenario.steps if s.function_call is not None]
    (handoff,) = [c for c in calls if c.name == "handoff_to_agent"]
    assert handoff.arguments["agent"] in agents.get(None).handoffs
    assert {c.name for c in calls} - {"handoff_to_agent"} <= set(TOOLS)
