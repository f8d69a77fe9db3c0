"""The import-time check of torch's private APIs (``_compat``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from resumable_loader.core import compat as _compat


def test_the_installed_torch_has_every_private_api_we_use() -> None:
    _compat.check_torch()  # what importing the package already did


def test_a_missing_api_is_an_import_error_naming_torch_and_the_api() -> None:
    apis = (
        ("torch", "UntypedStorage._no_such_api_", "sending a batch"),
        ("torch", "UntypedStorage._share_fd_cpu_", "present"),
        ("torch.utils.data._utils._no_such_module", None, "a worker"),
    )
    with pytest.raises(ImportError) as info:
        _compat.check_torch(apis)
    msg = str(info.value)
    assert f"torch {torch.__version__}" in msg
    assert "torch.UntypedStorage._no_such_api_ (used for sending a batch)" in msg
    assert "torch.utils.data._utils._no_such_module (used for a worker)" in msg
    assert "_share_fd_cpu_" not in msg
    assert _compat.TESTED_TORCH in msg


def test_the_tested_range_is_what_pyproject_declares() -> None:
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    declared = re.search(r'"torch([^"]*)"', pyproject)
    assert declared is not None
    assert declared.group(1) == _compat.TESTED_TORCH
    bounds = re.fullmatch(r">=([\d.]+),<([\d.]+)", _compat.TESTED_TORCH)
    assert bounds is not None
    lo, hi = bounds.groups()
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert tuple(map(int, lo.split("."))) <= version < tuple(map(int, hi.split(".")))


def test_a_missing_python_api_is_an_import_error_naming_python_and_the_api() -> None:
    apis = (("random", "_no_such_api_", "seeding"), ("random", "_inst", "present"))
    with pytest.raises(ImportError, match=r"random\._no_such_api_ \(used for seeding\)") as info:
        _compat.check_python(apis)
    assert "_inst" not in str(info.value)


def test_python_random_instance_is_what_the_random_module_draws_from() -> None:
    import random

    inst = _compat.python_random_instance()
    state = random.getstate()
    try:
        inst.seed(7)
        first = random.random()
        random.seed(7)
        assert random.random() == first
    finally:
        random.setstate(state)


def test_the_shared_allocator_can_be_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "_new_using_fd_cpu"
    # Recorded as it is (inherited, or the class's own), and put back so after the test.
    monkeypatch.setattr(torch.UntypedStorage, name, getattr(torch.UntypedStorage, name))
    original = _compat.shared_allocator()
    calls: list[int] = []

    def counting(cls: type, nbytes: int) -> torch.UntypedStorage:
        calls.append(nbytes)
        return original(nbytes)

    _compat.set_shared_allocator(counting)
    storage = _compat.shared_allocator()(128)
    assert calls == [128] and storage.nbytes() == 128 and storage.is_shared()


def test_a_missing_numpy_api_is_an_import_error_naming_numpy_and_the_api() -> None:
    import numpy as np

    apis = (("numpy.random", "_no_such_api_", "seeding"), ("numpy.random.mtrand", "_rand", "ok"))
    with pytest.raises(
        ImportError, match=r"numpy\.random\._no_such_api_ \(used for seeding\)"
    ) as e:
        _compat.check_numpy(apis)
    assert f"numpy {np.__version__}" in str(e.value) and "_rand" not in str(e.value)


def test_a_missing_instance_attribute_is_named_with_the_class() -> None:
    instance_apis = (
        ("torch.utils.data", "RandomSampler", (range(1),), "_no_such_attr_", "sharding"),
        ("torch.utils.data", "RandomSampler", (range(1),), "_num_samples", "present"),
    )
    with pytest.raises(ImportError) as info:
        _compat.check_torch((), instance_apis)
    msg = str(info.value)
    assert "torch.utils.data.RandomSampler()._no_such_attr_ (used for sharding)" in msg
    assert "_num_samples" not in msg


def test_the_storage_accessors_send_a_storage_through_its_fd() -> None:
    storage = torch.arange(10, dtype=torch.uint8).untyped_storage()
    fd, size = _compat.storage_share_fd()(storage)
    other = _compat.storage_from_fd()(fd, size)  # (maps its own duplicate of the fd)
    assert bytes(other) == bytes(range(10))
    key = _compat.storage_identity()
    view = torch.frombuffer(bytearray(4), dtype=torch.uint8)
    assert key(view.untyped_storage()) == key(view[1:].untyped_storage())
    assert key(storage) != key(other)


def test_the_tensor_and_rng_accessors() -> None:
    import numpy as np

    t = torch.tensor([1.0, -2.0])
    assert _compat.neg_view()(t).is_neg()
    rand, bg = _compat.numpy_global_rng()
    state = np.random.get_state()
    try:
        rand.seed(3)
        first = np.random.random()
        np.random.seed(3)
        assert np.random.random() == first
    finally:
        np.random.set_state(state)
    assert _compat.numpy_bit_generator(rand) is bg
    assert _compat.random_sampler_num_samples(torch.utils.data.RandomSampler(range(5))) is None
    given = torch.utils.data.RandomSampler(range(5), num_samples=3)
    assert _compat.random_sampler_num_samples(given) == 3


def test_sharing_goes_through_a_replaced_share_method(monkeypatch: pytest.MonkeyPatch) -> None:
    # testing.ShmFailure replaces _share_fd_cpu_ in a worker after the transport bound its
    # accessor at import: the accessor must still reach the replacement.
    share = _compat.storage_share_fd()
    monkeypatch.setattr(torch.UntypedStorage, "_share_fd_cpu_", lambda self: (-1, 0))
    assert share(torch.UntypedStorage(8)) == (-1, 0)
