"""The process's LISTEN connection (app/pg_listener.py): notifications reach their channel's
handlers in order, and a lost connection is replaced, its subscribers told to catch up."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from app.db import plain_url
from app.pg_listener import PgListener
from tests.e2e_support import wait_until


async def _notify(url: str, *pairs: tuple[str, str]) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for channel, payload in pairs:
            await conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))


async def test_notifications_reach_their_channels_handlers_in_order(clean_db: str) -> None:
    url = plain_url(clean_db)
    first: list[str] = []
    second: list[str] = []
    listener = PgListener(url)
    listener.subscribe("lst_first", first.append)
    listener.subscribe("lst_second", second.append)
    await listener.start()
    try:
        await _notify(url, ("lst_first", "a"), ("lst_second", "b"), ("lst_first", "c"))
        await wait_until(lambda: len(first) == 2 and len(second) == 1, 5, "notifications")
        # Later ones too: the socket is watched again after each read.
        await _notify(url, *[("lst_first", str(i)) for i in range(50)])
        await wait_until(lambda: len(first) == 52, 5, "the later notifications")
    finally:
        await listener.stop()
    assert first == ["a", "c", *[str(i) for i in range(50)]]
    assert second == ["b"]


async def test_a_lost_connection_is_replaced_and_its_subscribers_catch_up(clean_db: str) -> None:
    url = plain_url(clean_db)
    heard: list[str] = []
    listens: list[float] = []
    listener = PgListener(url, reconnect_s=0.1)
    listener.subscribe("lst_lost", heard.append)
    listener.on_listen(lambda: listens.append(asyncio.get_running_loop().time()))
    await listener.start()
    try:
        await _notify(url, ("lst_lost", "before"))
        await wait_until(lambda: heard == ["before"], 5, "the first notification")
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE query LIKE 'LISTEN%%' AND datname = current_database() "
                "AND pid <> pg_backend_pid()"
            )
        await wait_until(lambda: len(listens) == 2, 10, "LISTEN again")
        await _notify(url, ("lst_lost", "after"))
        await wait_until(lambda: heard == ["before", "after"], 5, "a notification after")
    finally:
        await listener.stop()


async def test_an_idle_listener_does_not_wake_ten_times_a_second(clean_db: str) -> None:
    # psycopg's wait wakes every 0.1 s with nothing to read (its interval against Ctrl-C):
    # ten wake-ups a second of an idle process. The LISTEN connection's waits are long, and a
    # notification still ends one at once.
    url = plain_url(clean_db)
    heard: list[str] = []
    listener = PgListener(url)
    listener.subscribe("lst_idle", heard.append)
    await listener.start()
    loop = asyncio.get_running_loop()
    timers: list[float] = []
    call_later = loop.call_later

    def counting(delay: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(callback, "__module__", None) == "psycopg.waiting":
            timers.append(delay)
        return call_later(delay, callback, *args, **kwargs)

    try:
        loop.call_later = counting  # type: ignore[method-assign]
        try:
            await asyncio.sleep(0.65)  # nothing but the listener's wait on psycopg's clock
        finally:
            del loop.call_later
        await _notify(url, ("lst_idle", "now"))
        await wait_until(lambda: heard == ["now"], 5, "the notification")
    finally:
        await listener.stop()
    # Its wait may begin inside the window (one long timer); no short one may.
    short = [delay for delay in timers if delay < 1.0]
    assert short == [], f"the idle listener woke {len(short)} times in 0.65 s"
