"""kept.keep: the caches of what a kind of call needs stay within their limit and start over when full."""

from shmcoll.kept import keep


def test_a_full_cache_starts_over_with_the_new_entry():
    cache: dict[int, str] = {}
    for k in range(3):
        assert keep(cache, k, f"v{k}", 3) == f"v{k}"
    assert cache == {0: "v0", 1: "v1", 2: "v2"}  # up to the limit, nothing is dropped
    assert keep(cache, 7, "v7", 3) == "v7"
    assert cache == {7: "v7"}


def test_a_kept_none_is_an_entry():
    """Where a kind of call is known not to have the common case, None is kept as its answer."""
    cache: dict[str, None] = {}
    assert keep(cache, "odd", None, 4) is None
    assert "odd" in cache
