"""Affinity store: replica registry, session affinity and prefix records (Redis or memory)."""

from service.affinity.base import (
    AffinityStore,
    AffinityStoreError,
    ReplicaInfo,
    ReplicaLoad,
    ReplicaStatus,
)
from service.affinity.config import AffinityConfig
from service.affinity.factory import create_store

__all__ = [
    "AffinityConfig",
    "AffinityStore",
    "AffinityStoreError",
    "ReplicaInfo",
    "ReplicaLoad",
    "ReplicaStatus",
    "create_store",
]
