"""The served benchmarks' tests run against the same real server the service tests start."""

from tests.service.conftest import engine, server, start_server  # noqa: F401
