"""Who is calling and which cache salt that gives: one rule for the replica and the router.

With auth on (`--auth-token TOKEN:TENANT`, repeatable) every call carries
`authorization: Bearer <token>`; the token names the caller's tenant. The tenant's prefix cache
is its own: the engine hashes its blocks with the salt `tenant:<name>` (plus the client's
`cache_salt` when `--allow-client-cache-salt`). With auth off the client's `cache_salt` is the
salt. The router derives the same salt to find the blocks the replica will hash.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from typing import Any


class Unauthenticated(Exception):
    """The call has no bearer token, a malformed one, or one nobody issued (the message says)."""


def parse_auth_token(spec: str) -> tuple[str, str]:
    """`TOKEN:TENANT` -> (token, tenant); a bare `TOKEN` gets a tenant named after its hash."""
    token, sep, tenant = spec.partition(":")
    if not sep:
        tenant = "tenant-" + hashlib.sha256(token.encode()).hexdigest()[:12]
    if not token or not tenant:
        raise ValueError(f"auth token must be TOKEN or TOKEN:TENANT, got {spec!r}")
    return token, tenant


class Auth:
    """The issued bearer tokens and their tenants; no tokens means auth is off."""

    def __init__(self, auth_tokens: Sequence[tuple[str, str]] = ()) -> None:
        self._tokens = [(t.encode(), tenant) for t, tenant in auth_tokens]

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def tenant_for(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """The caller's tenant (None with auth off); raises Unauthenticated otherwise."""
        if not self._tokens:
            return None
        header = ""
        for key, value in metadata or ():
            if key.lower() == "authorization" and isinstance(value, str):
                header = value
        if not header:
            raise Unauthenticated("missing `authorization: Bearer <token>` metadata")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("authorization metadata must be `Bearer <token>`")
        given = token.strip().encode()
        tenant = None
        for known, name in self._tokens:  # NOTE: compare with every token (constant time)
            if hmac.compare_digest(known, given):
                tenant = name
        if tenant is None:
            raise Unauthenticated("unknown bearer token")
        return tenant


def derive_cache_salt(tenant: str | None, client_salt: str, allow_client: bool) -> str | None:
    """The salt the engine gets: the tenant's own with auth on, else the client's (if any)."""
    if tenant is None:
        return client_salt or None
    salt = "tenant:" + tenant
    if allow_client and client_salt:
        salt += "\x00client:" + client_salt
    return salt
