"""The SIP listener judged by the real sipp, with the Realtime simulator behind the bridge."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine

from tests.e2e_support import call_row, event_rows, wait_until
from tests.sipp_support import RecordingGateway, needs_sipp, pcap_dir, run_sipp, sip_stack

pytestmark = needs_sipp


async def test_sipp_uac_pcap_call_reaches_the_model_as_pcma_and_its_digit_the_tool_layer(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    (tmp_path / "pcap").symlink_to(pcap_dir())
    gateway = RecordingGateway()
    async with sip_stack(engine, gateway=gateway) as stack:
        sip = stack.service.runtime.sip
        run = await run_sipp(sip.port, "uac_pcap", tmp_path, timeout_s=40)
        assert run.returncode == 0, run.explain()
        session = await stack.sim.wait_for_session(0)
        fmt = session.config.audio.input.format
        assert fmt is not None and fmt.type == "audio/pcma"
        assert session.received_events("input_audio_buffer.append")
        await wait_until(lambda: gateway.digits, 10, "digit at the tool layer")
        call_id = gateway.digits[0][0]
        assert [d for _, d in gateway.digits] == ["1"]
        await wait_until(lambda: sip.live_calls() == 0, 10, "call over")
        row = await call_row(engine, call_id)
        assert row is not None and row["leg"] == "sip" and row["status"] == "completed"
        await stack.service.runtime.events.flush()
        kinds = [r["kind"] for r in await event_rows(engine, row["id"])]
        assert "dtmf" in kinds and kinds[-1] == "call_ended"
