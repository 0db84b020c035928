"""``clients.route.Route``: one call's replies in order, a wait woken by the next one, nothing lost to
a cancelled wait, and a closed route refusing more."""

from __future__ import annotations

import anyio
import pytest

from clients.route import Route


def test_messages_come_out_in_order_and_a_wait_is_woken_by_the_next_put() -> None:
    async def main() -> list[int]:
        route, got = Route(), []
        assert route.put({"n": 0}) and route.put({"n": 1})

        async def read() -> None:
            for _ in range(4):
                got.append((await route.get())["n"])

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await anyio.sleep(0.01)  # the reader took both and waits
                assert got == [0, 1]
                route.put({"n": 2})
                await anyio.sleep(0.01)
                route.put({"n": 3})
        return got

    assert anyio.run(main) == [0, 1, 2, 3]


def test_a_cancelled_wait_loses_nothing_and_a_closed_route_ends_its_reader() -> None:
    async def main() -> None:
        route = Route()
        with anyio.move_on_after(0.01):
            await route.get()  # nothing yet: cancelled while waiting
        route.put({"n": 5})
        assert await route.get() == {"n": 5}
        route.put({"n": 6})
        route.close()
        assert not route.put({"n": 7})  # its call ended: the pump drops the route
        assert await route.get() == {"n": 6}  # what arrived before the close is still read
        with pytest.raises(anyio.EndOfStream):
            await route.get()

    anyio.run(main)


def test_closing_wakes_a_waiting_reader() -> None:
    async def main() -> None:
        route = Route()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_close_later, route)
                with pytest.raises(anyio.EndOfStream):
                    await route.get()

    anyio.run(main)


async def _close_later(route: Route) -> None:
    await anyio.sleep(0.01)
    route.close()
