"""`distserve plan --live` never prints a run's Redis password."""

from distserve.commands.live import without_password


def test_a_redis_url_is_printed_without_its_password() -> None:
    assert without_password("redis://:s3cret@127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert without_password("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379"
