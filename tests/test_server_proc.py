"""The tests' `voice-agent serve` process (tests/server_proc.py): a port picked free and
taken by another process before the server binds it (a parallel test's server, an outgoing
connection's ephemeral port) does not fail the test that started it."""

from __future__ import annotations

import socket

import httpx

from tests.server_proc import ServerProcess


async def test_a_server_whose_port_was_taken_meanwhile_starts_on_another(clean_db: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = int(holder.getsockname()[1])
        server = ServerProcess({"DATABASE_URL": clean_db}, port=taken)
        try:
            await server.start()
            async with httpx.AsyncClient() as http:
                ready = await http.get(server.url + "/readyz")
        finally:
            await server.stop()
    assert server.port != taken
    assert ready.status_code == 200
