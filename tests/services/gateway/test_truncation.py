"""`truncation: auto` through a real stack whose KV pool holds a short context (one colocated
worker, 24 MiB of KV: some 544 tokens of SmolLM2): a conversation kept turn after turn reaches
the context, where `disabled` (the default) is a 400 naming it and `auto` answers from the
latest turns that fit, and the conversation goes on from that answer."""

from __future__ import annotations

import re
from collections.abc import Iterator

import openai
import pytest

from services.launcher import Stack
from tests.services.conftest import start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "smollm2-135m"
TURN = ("Here is a note about the lighthouse on the north cape, its keepers, its lamp and "
        "the ships it guided through the winter storms of the old century. ") * 3


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("short"), mode="colocated", replicas=1,
                        kv_cache_mb=24)
    yield stack
    stack.stop()


def test_a_conversation_past_the_context_is_answered_from_its_latest_turns(
        short: Stack) -> None:
    c = openai.OpenAI(base_url=f"{short.url}/v1", api_key="none", timeout=300, max_retries=0)
    before = None
    for turn in range(12):
        try:
            answer = c.responses.create(model=MODEL, input=f"{turn}. {TURN}", temperature=0,
                                        max_output_tokens=16, previous_response_id=before)
        except openai.BadRequestError as e:
            exceeded = e
            break
        assert answer.truncation == "disabled"
        before = answer.id
    else:
        pytest.fail("twelve turns never reached the context")
    assert exceeded.code == "context_length_exceeded" and turn >= 2
    limit, whole = (int(re.search(pattern, exceeded.message)[1])  # type: ignore[index]
                    for pattern in (r"context length is (\d+) tokens", r"prompt \((\d+) tokens"))
    assert 500 <= limit <= 560  # 24 MiB of blocks
    cut = c.responses.create(model=MODEL, input=f"{turn}. {TURN}", temperature=0,
                             max_output_tokens=16, previous_response_id=before,
                             truncation="auto")
    assert cut.truncation == "auto" and cut.output_text and cut.usage is not None
    # its earliest turns dropped, not all but the last: a turn is at most 240 tokens
    assert limit - 240 < cut.usage.input_tokens + 16 <= limit
    assert cut.usage.input_tokens < whole
    again = c.responses.create(model=MODEL, input="And the lamp?", temperature=0,
                               max_output_tokens=16, previous_response_id=cut.id,
                               truncation="auto")
    assert again.previous_response_id == cut.id and again.usage is not None
    assert again.usage.input_tokens + 16 <= limit
