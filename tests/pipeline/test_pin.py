"""Pinning (``_pin``): ``pin_memory`` walks containers the way torch's loader does."""

from __future__ import annotations


class _SelfPinningDict(dict):
    def pin_memory(self):
        return "pinned by its own method"


class _Pair(tuple):
    pass


def test_pin_memory_treats_containers_as_torch_does() -> None:
    import collections

    from resumable_loader.pipeline.pin import pin_memory

    # An object's own pin_memory() wins, even on a mapping or a sequence.
    assert pin_memory(_SelfPinningDict(a=1)) == "pinned by its own method"
    # Container types survive (a tuple subclass, a defaultdict with its default factory).
    pair = pin_memory(_Pair((1, "x")))
    assert type(pair) is _Pair and pair == (1, "x")
    dd = pin_memory(collections.defaultdict(list, a=1))
    assert type(dd) is collections.defaultdict and dd.default_factory is list
