"""The public surface: what ``resumable_loader`` and ``resumable_loader.testing`` export.

A name added or removed here is an API change: this test makes it a deliberate one."""

from __future__ import annotations

import pickle
import types

import resumable_loader
import resumable_loader.testing

PUBLIC = [
    "CheckpointError",
    "DataLoader",
    "LoaderClosedError",
    "LoaderStatistics",
    "Mixture",
    "RetryPolicy",
    "Stream",
    "WorkerCrashError",
    "__version__",
    "dump_state",
    "load_state",
    "merge_rank_states",
    "pack_collate",
    "save_checkpoint",
    "skip_samples",
]

TESTING = [
    "Fault",
    "FaultyDataset",
    "FaultyStream",
    "Resources",
    "ShmFailure",
    "canonical",
    "check_resume",
    "kill_at",
    "kill_worker",
    "leaks_since",
    "reference_stream",
    "roundtrip_state",
    "same_state",
    "worker_pids",
]


def test_the_package_exports_exactly_its_public_names_sorted() -> None:
    assert resumable_loader.__all__ == PUBLIC == sorted(PUBLIC)
    public_attrs = {
        name
        for name, value in vars(resumable_loader).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public_attrs <= set(PUBLIC), f"public but not exported: {public_attrs - set(PUBLIC)}"


def test_public_objects_belong_to_the_package() -> None:
    for name in PUBLIC:
        obj = getattr(resumable_loader, name)
        if hasattr(obj, "__module__"):
            assert obj.__module__ == "resumable_loader", (name, obj.__module__)
    err = resumable_loader.WorkerCrashError("x", task_id=3)
    assert repr(type(err)) == "<class 'resumable_loader.WorkerCrashError'>"
    back = pickle.loads(pickle.dumps(err))  # by reference, under the package's name
    assert type(back) is resumable_loader.WorkerCrashError and back.task_id == 3
    policy = resumable_loader.RetryPolicy(attempts=2)
    assert pickle.loads(pickle.dumps(policy)) == policy


def test_the_testing_module_exports_exactly_its_tools() -> None:
    assert resumable_loader.testing.__all__ == TESTING == sorted(TESTING)
    for name in TESTING:
        assert hasattr(resumable_loader.testing, name), name
