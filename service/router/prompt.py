"""The router's view of a prompt: its token ids and block-hash chain, exactly as a replica's.

Both come from `engine/frontend/prompt.py`, the one rule the engine uses too, with the replica's model
id, block size and the cache salt the replica will use (`service.common.auth.derive_cache_salt`).
Chat prompts are tokenized a message at a time from cached pieces where the tokenizer allows
(service/router/chat_tokens.py). Without a tokenizer only token-id prompts get a chain.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.frontend.prompt import prompt_block_hashes, tokenize_prompt
from engine.kv.hashing import BlockHash
from service.api.deja.v1 import inference_pb2 as pb
from service.common.auth import Auth, Unauthenticated, derive_cache_salt
from service.router.chat_tokens import ChatTokenizer

log = logging.getLogger(__name__)


def load_router_tokenizer(model: str | None, cache_dir: str) -> Any | None:
    """The model folder's tokenizer ("demo" resolves to the converted demo folder); blocking."""
    if not model:
        return None
    from engine.demo import resolve_model_path
    from engine.worker.model_loader import load_tokenizer

    return load_tokenizer(resolve_model_path(model, Path(cache_dir).expanduser()))


class PromptHasher:
    def __init__(
        self,
        tokenizer: Any | None,
        auth_tokens: Sequence[tuple[str, str]] = (),
        allow_client_cache_salt: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self._chat = ChatTokenizer(tokenizer) if tokenizer is not None else None
        self._auth = Auth(auth_tokens)
        self._allow_client_salt = allow_client_cache_salt

    def token_ids(self, request: pb.GenerateRequest) -> list[int] | None:
        """The prompt's token ids, or None when the router cannot tell (no tokenizer, bad input)."""
        which = request.WhichOneof("input")
        if which != "token_ids" and self.tokenizer is None:
            return None
        try:
            if which == "chat":
                messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
                assert self._chat is not None
                return self._chat.ids(messages)
            if which == "text":
                return tokenize_prompt(self.tokenizer, request.text)
            if which == "token_ids":
                return tokenize_prompt(None, list(request.token_ids.ids))
        except Exception as e:  # the replica reports bad input; routing just goes without
            log.debug("cannot tokenize request %s: %s", request.request_id, e)
        return None

    def cache_salt(
        self, request: pb.GenerateRequest, metadata: Sequence[tuple[str, Any]]
    ) -> str | None:
        """The salt the replica will hash with (the tenant's when the replicas run with auth)."""
        try:
            tenant = self._auth.tenant_for(metadata)
        except Unauthenticated:
            return None  # the replica will refuse the call anyway
        return derive_cache_salt(tenant, request.cache_salt, self._allow_client_salt)

    def chain(
        self,
        token_ids: Sequence[int],
        model_id: str,
        block_size: int,
        cache_salt: str | None,
    ) -> list[BlockHash]:
        return prompt_block_hashes(token_ids, block_size, model_id, cache_salt)


class PromptChains:
    """One request's token ids and hash chains, computed at most once and off the event loop."""

    def __init__(self, hasher: PromptHasher, request: pb.GenerateRequest, salt: str | None):
        self._hasher = hasher
        self._request = request
        self._salt = salt
        self._ids: asyncio.Task[list[int] | None] | None = None
        self._chains: dict[tuple[str, int], list[BlockHash]] = {}

    def start(self) -> None:
        if self._ids is None:
            self._ids = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self._hasher.token_ids, self._request)
            )

    async def chain(self, model_id: str, block_size: int) -> list[BlockHash]:
        self.start()
        assert self._ids is not None
        ids = await self._ids
        if ids is None:
            return []
        key = (model_id, block_size)
        if key not in self._chains:
            self._chains[key] = self._hasher.chain(ids, model_id, block_size, self._salt)
        return self._chains[key]

    async def num_tokens(self) -> int:
        """The prompt's length in tokens (0 when the router cannot tokenize it)."""
        self.start()
        assert self._ids is not None
        ids = await self._ids
        return len(ids) if ids is not None else 0

    def cancel(self) -> None:
        if self._ids is not None and not self._ids.done():
            self._ids.cancel()
