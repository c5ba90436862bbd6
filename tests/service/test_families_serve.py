"""Each family through a real `deja serve`: a two-turn chat (the checkpoint's chat template)
gets answers, and the second turn is served partly from the prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from clients.client import DejaClient
from clients.session import ChatSession
from engine.testing.tiny_models import FAMILY_BUILDERS
from tests.service.serving import serving

BLOCK_SIZE = 16  # deja serve's default


@pytest.mark.parametrize("family", sorted(FAMILY_BUILDERS))
def test_two_turn_chat_hits_the_prefix_cache(
    family: str, tiny_family: Callable[[str], Path], tmp_path: Path
) -> None:
    with (
        serving(tiny_family(family), tmp_path, grace=1.0) as served,
        DejaClient(served.target) as client,
    ):
        session = ChatSession(
            client, system="You are Deja. Be brief.", max_tokens=8, temperature=0.0
        )
        session.ask("What is your name? Please tell me a story about a robot who learns to paint.")
        first = session.last_result
        assert first is not None and first.usage.completion_tokens > 0
        turn1_prompt = first.usage.prompt_tokens
        assert first.usage.cached_prompt_tokens == 0
        session.ask("How are you today?")
        second = session.last_result
        assert second is not None and second.usage.completion_tokens > 0
        assert second.usage.prompt_tokens > turn1_prompt
        # At least every full block of turn 1's prompt (the system and first user messages
        # render the same in turn 2) comes from the cache.
        assert second.usage.cached_prompt_tokens >= turn1_prompt // BLOCK_SIZE * BLOCK_SIZE > 0
