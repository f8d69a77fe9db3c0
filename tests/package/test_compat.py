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
