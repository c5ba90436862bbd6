"""service/router/popularity.py: shares of recent traffic per leading prompt block."""

from __future__ import annotations

import pytest

from service.router.popularity import PrefixPopularity, counted_depths, share_at


def _chain(tag: str, n: int, shared: int = 0) -> list[bytes]:
    """n block hashes; the first `shared` are common to every tag."""
    return [f"common-{i}".encode() if i < shared else f"{tag}-{i}".encode() for i in range(n)]


def test_counted_depths_are_powers_of_two_less_one_and_the_last() -> None:
    assert counted_depths(0) == []
    assert counted_depths(1) == [0]
    assert counted_depths(5) == [0, 1, 3, 4]
    assert counted_depths(8) == [0, 1, 3, 7]
    assert counted_depths(450) == [0, 1, 3, 7, 15, 31, 63, 127, 255, 449]


def test_shares_count_requests_per_depth_and_bound_deeper_ones() -> None:
    pop = PrefixPopularity()
    a, b = _chain("a", 10, shared=3), _chain("b", 10, shared=3)
    assert pop.shares(a, 0.0) == ()
    for _ in range(4):
        pop.observe(a, 0.0)
    pop.observe(b, 0.0)
    shares = dict(pop.shares(a, 0.0))
    assert shares == {0: 1.0, 1: 1.0, 3: pytest.approx(0.8), 7: pytest.approx(0.8), 9: 0.8}
    assert dict(pop.shares(_chain("c", 4, shared=3), 0.0))[3] == 0.0  # never seen that deep
    # depth 5 is not counted: the share at depth 3 bounds it
    assert share_at(pop.shares(a, 0.0), 5) == pytest.approx(0.8)
    assert share_at(((2, 0.5),), 1) is None
    # track: the shares before this request, then the request counted
    assert dict(pop.track(b, 0.0))[9] == pytest.approx(0.2)
    assert dict(pop.shares(b, 0.0))[9] == pytest.approx(2 / 6)


def test_counts_decay_with_their_half_life_and_memory_is_capped() -> None:
    pop = PrefixPopularity(half_life_s=60.0)
    a, b = _chain("a", 4), _chain("b", 4)
    for _ in range(4):
        pop.observe(a, 0.0)
    for _ in range(4):
        pop.observe(b, 60.0)  # a's 4 count as 2 by now
    assert dict(pop.shares(a, 60.0))[0] == pytest.approx(2 / 6)
    assert dict(pop.shares(b, 60.0))[0] == pytest.approx(4 / 6)
    small = PrefixPopularity(max_entries=3)
    small.observe(a, 0.0)  # depths 0, 1, 3
    small.observe(b, 0.0)
    assert dict(small.shares(a, 0.0)) == {0: 0.0, 1: 0.0, 3: 0.0}  # a's counts went first
    with pytest.raises(ValueError):
        PrefixPopularity(half_life_s=0)


def test_track_in_one_pass_equals_shares_then_observe() -> None:
    one, two = PrefixPopularity(half_life_s=30.0), PrefixPopularity(half_life_s=30.0)
    chains = [_chain(t, n, shared=2) for t, n in (("a", 9), ("b", 3), ("a", 9), ("c", 1))]
    for i in range(40):
        chain, now = chains[i % len(chains)], 2.5 * i
        expected = two.shares(chain, now)
        two.observe(chain, now)
        got = one.track(chain, now)
        assert [d for d, _ in got] == [d for d, _ in expected]
        assert [s for _, s in got] == pytest.approx([s for _, s in expected])
    assert one.track(_chain("z", 2), 100.0) != ()
    assert PrefixPopularity().track(_chain("z", 2), 0.0) == ()  # nothing before it
