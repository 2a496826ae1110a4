"""What every bad-input table (tests/test_bad_input*.py) shares: torch's fake process group for
the rows that need one, and the rule a refusal must follow — the right exception, one line, the
words that tell the learner what to change."""
import pytest
import torch.distributed as dist

WORLD = 4   # the fake process group's size


@pytest.fixture
def fake_world():
    """torch's fake process group: collectives return at once and move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def params(cases):
    """(id, call, error, words, needs_group) rows as pytest parameters named by their id."""
    return [pytest.param(*row[1:], id=row[0]) for row in cases]


def assert_refused_in_one_sentence(request, call, error, words, needs_group):
    if needs_group:
        request.getfixturevalue("fake_world")
    with pytest.raises((ValueError, TypeError)) as caught:
        call()
    assert type(caught.value) is error, f"{type(caught.value).__name__}: {caught.value}"
    message = str(caught.value)
    assert "\n" not in message.strip(), f"more than one line: {message!r}"
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in {message!r}"
