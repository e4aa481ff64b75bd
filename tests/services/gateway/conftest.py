"""One locked-down stack (1 prefill + 1 decode, real servers with the run's credentials, an
API key on the gateway) shared by the gateway, fuzz and access tests of this package: each
start costs a model load per worker, and none of these tests may change the stack (they
assert it afterwards)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.launcher import Stack
from tests.services.conftest import start_stack

API_KEY = "sk-test-gateway"
OTHER_KEY = "sk-test-another-tenant"  # whose responses the first key's are not


@pytest.fixture(scope="package")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("secured"), prefill=1, decode=1,
                    api_keys=[API_KEY, OTHER_KEY])
    yield s
    s.stop()
