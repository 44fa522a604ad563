"""The CLI's tests run against the same in-process broker and engine sessions as the clients' tests."""

from tests.clients.conftest import broker, engine_info, recorder, sessions  # noqa: F401
