"""Agents files (AGENTS_FILE): checked against the catalog at start, refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from telephony.sim.scenario import load_scenario
from tests.cli_support import clean_env, error_lines, run_cli
from tools.agents import AgentsFileError, load_agents_file, load_agents_text
from tools.catalog import CatalogError
from tools.restaurant import plugin
from tools.tools_file import load_tools_text

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


# --- agents in the tools file --------------------------------------------------------------

# A one-tool shop, for files that add their own sections after it.
SHOP_TOOLS = """\
version: 1
name: shop
providers:
  shop: {base_url: "http://127.0.0.1:9"}
tools:
  - name: order_status
    kind: read
    description: Say where an order stands, when the caller asks about one.
    arguments: {type: object, properties: {order_id: {type: string}}, required: [order_id]}
    request: {path: "/orders/{args.order_id}"}
"""
SHOP = (
    SHOP_TOOLS
    + """\
agents:
  - name: clerk
    instructions: You are the shop's clerk.
    tools: [order_status]
    handoffs: [supervisor]
    voice: cedar
  - name: supervisor
    instructions: You are the supervisor.
start_agent: supervisor
"""
)


def test_a_tools_file_can_declare_its_agents_beside_its_tools() -> None:
    catalog = load_tools_text(SHOP, source="shop.yaml", environ={})
    assert catalog.agents is not None
    assert catalog.agents.start == "supervisor"
    assert catalog.agents.get("clerk").voice == "cedar"
    assert catalog.agents.get("clerk").tools == {"order_status"}
    assert catalog.agents.get("supervisor").voice is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (SHOP.replace("tools: [order_status]", "tools: [refund]"),
         "shop.yaml:14: agents[0].tools[0]: no tool 'refund' in the catalog. Fix: name one of"),
        (SHOP.replace("start_agent: supervisor", "start_agent: chef"),
         "shop.yaml:19: start_agent: no agent named 'chef'. Fix: start with"),
        (SHOP.replace("voice: cedar", "voice: Loud Voice!"),
         "shop.yaml:16: agents[0].voice: String should match"),
    ],
    ids=["unknown-tool", "bad-start", "bad-voice"],
)  # fmt: skip
def test_a_tools_files_agents_are_checked_at_their_line(text: str, expected: str) -> None:
    with pytest.raises(CatalogError) as exc:
        load_tools_text(text, source="shop.yaml", environ={})
    assert expected in str(exc.value), str(exc.value)


async def test_tools_check_lists_the_agents_and_serve_refuses_agents_in_two_places(
    tmp_path: Path,
) -> None:
    shop = tmp_path / "shop.yaml"
    shop.write_text(SHOP)
    env = clean_env(DATABASE_URL=NO_DATABASE, TOOLS_FILE=str(shop))
    code, out, err = await run_cli("tools", "check", env=env, cwd=tmp_path)
    assert code == 0, err
    assert f"agents ({shop}), starting with supervisor:" in out
    assert "  clerk: tools: order_status; hands off to: supervisor; voice: cedar" in out
    # The same agents named by AGENTS_FILE too: which one holds is not guessed.
    agents = tmp_path / "agents.yaml"
    agents.write_text(GOOD.replace("[check_availability, book_table]", "[order_status]"))
    env = clean_env(DATABASE_URL=NO_DATABASE, TOOLS_FILE=str(shop), AGENTS_FILE=str(agents))
    code, _, err = await run_cli("tools", "check", env=env, cwd=tmp_path)
    assert code == 2, err
    (line,) = error_lines(err)
    assert "declares agents too. Fix: declare them in one place" in line, line
