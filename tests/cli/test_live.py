"""`distserve plan --live`: a recorded plan as printed, and never a run's Redis password."""

from distserve.commands.live import layout, without_password


def test_a_redis_url_is_printed_without_its_password() -> None:
    assert without_password("redis://:s3cret@127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert without_password("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379"


def test_a_recorded_plan_names_its_workers_and_their_shapes() -> None:
    split = {"mode": "disaggregated", "prefill": 1, "decode": 2,
             "prefill_shape": {"tp": 2, "pp": 1}, "decode_shape": {"tp": 1, "pp": 1}}
    assert layout(split) == "1 prefill tp2 + 2 decode"
    assert layout(split, short=True) == "1P tp2+2D"
    # records written before plans had shapes: one device each
    assert layout({"mode": "disaggregated", "prefill": 1, "decode": 1}, short=True) == "1P+1D"
    assert layout({"mode": "chunked", "colocated": 2,
                   "colocated_shape": {"tp": 2, "pp": 2}}) == "2 chunked colocated tp2 pp2"
