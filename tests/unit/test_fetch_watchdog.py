"""The stall detector re-reads only partitions whose fetch position stays ahead of delivery."""

from pipeline.fetch_watchdog import StallDetector


def test_progressing_partition_is_never_reseeked() -> None:
    d = StallDetector()
    for delivered in range(0, 50, 5):
        assert d.observe("p0", position=delivered + 20, delivered=delivered, start=0) is None


def test_caught_up_partition_is_not_suspect() -> None:
    d = StallDetector()
    for _ in range(5):
        assert d.observe("p0", position=11, delivered=10, start=0) is None
        assert d.observe("p1", position=0, delivered=None, start=0) is None


def test_fetched_but_undelivered_records_are_re_read_from_the_first_undelivered() -> None:
    d = StallDetector()
    assert d.observe("p2", position=22, delivered=7, start=0) is None  # first sight: maybe in flight
    assert d.observe("p2", position=22, delivered=7, start=0) == 8  # still stuck: re-read from 8


def test_nothing_delivered_resumes_from_the_start_offset() -> None:
    d = StallDetector()
    d.observe("p0", position=18, delivered=None, start=5)
    assert d.observe("p0", position=18, delivered=None, start=5) == 5


def test_delivery_between_checks_clears_the_suspicion() -> None:
    d = StallDetector()
    d.observe("p0", position=30, delivered=10, start=0)
    assert d.observe("p0", position=30, delivered=12, start=0) is None  # it moved: count restarts
    assert d.observe("p0", position=30, delivered=12, start=0) == 13


def test_forget_drops_partitions_no_longer_assigned() -> None:
    d = StallDetector()
    d.observe("p0", position=30, delivered=10, start=0)
    d.forget(set())
    assert d.observe("p0", position=30, delivered=10, start=0) is None
