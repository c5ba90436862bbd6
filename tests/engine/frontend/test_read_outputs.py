"""`read_outputs`: a reader that falls behind gets the deltas it missed merged into one."""

from __future__ import annotations

import asyncio

import pytest

from engine.frontend.base import read_outputs
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob


def _delta(tokens: list[int], text: str, *, finish: str | None = None) -> RequestOutput:
    lps = [TokenLogprob(t, -0.5, []) for t in tokens]
    return RequestOutput(
        "r",
        [1, 2],
        [CompletionOutput(0, text, tokens, lps, finish_reason=finish)],
        finished=finish is not None,
    )


async def _read(items: list[RequestOutput | BaseException]) -> list[RequestOutput]:
    queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    taken: list[int] = []
    left: list[bool] = []
    out = []
    gen = read_outputs(
        queue, start=lambda: None, leave=left.append, on_read=lambda: taken.append(1)
    )
    async for o in gen:
        out.append(o)
    assert len(taken) == len(items) and left == [True]  # every item counted as taken
    return out


def test_queued_deltas_are_merged() -> None:
    got = asyncio.run(
        _read([_delta([5], "a"), _delta([6, 7], "bc"), _delta([8], "d", finish="length")])
    )
    assert len(got) == 1 and got[0].finished
    c = got[0].outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == ("abcd", [5, 6, 7, 8], "length")
    assert [lp.token_id for lp in c.logprobs or []] == [5, 6, 7, 8]


def test_an_error_after_deltas_comes_after_them() -> None:
    async def go() -> tuple[list[RequestOutput], BaseException | None]:
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        for item in (_delta([5], "a"), _delta([6], "b"), RuntimeError("engine died")):
            queue.put_nowait(item)
        out: list[RequestOutput] = []
        try:
            async for o in read_outputs(queue, start=lambda: None, leave=lambda f: None):
                out.append(o)
        except RuntimeError as e:
            return out, e
        return out, None

    out, err = asyncio.run(go())
    assert [o.outputs[0].text for o in out] == ["ab"] and str(err) == "engine died"


def test_samples_merge_by_index() -> None:
    a = RequestOutput("r", [], [CompletionOutput(0, "x", [1]), CompletionOutput(1, "y", [2])])
    b = RequestOutput("r", [], [CompletionOutput(1, "z", [3], finish_reason="stop")], True)
    m = a.merge(b)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in m.outputs] == [
        (0, "x", [1], None),
        (1, "yz", [2, 3], "stop"),
    ]
    assert m.finished


@pytest.mark.parametrize("n", [1, 3])
def test_a_reader_that_keeps_up_gets_every_delta(n: int) -> None:
    async def go() -> list[RequestOutput]:
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        out = []

        async def produce() -> None:
            for i in range(n):
                await asyncio.sleep(0.01)
                queue.put_nowait(_delta([i], str(i), finish="stop" if i == n - 1 else None))

        task = asyncio.create_task(produce())
        async for o in read_outputs(queue, start=lambda: None, leave=lambda f: None):
            out.append(o)
        await task
        return out

    assert [o.outputs[0].text for o in asyncio.run(go())] == [str(i) for i in range(n)]
