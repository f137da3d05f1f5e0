"""Rank agreement without a process group (the single-process twin of the distributed tests), and the
picklability of the exception hierarchy (errors travel between ranks)."""

from __future__ import annotations

import pickle

import pytest
import torch.distributed as dist

from accelerate_txn import agree, errors, on_main
from accelerate_txn.core.ranks import distributed, rank, run_phase, world_size
from accelerate_txn.errors import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointRankError,
)


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized(), "these tests are the no-process-group twins"


def test_without_process_group_this_is_rank_zero_of_one() -> None:
    assert (distributed(), rank(), world_size()) == (False, 0, 1)


def test_run_phase_returns_the_function_value() -> None:
    value = {"a": [1, 2]}
    assert run_phase(lambda: value, "Computing") is value


def test_run_phase_reraises_library_error_unchanged() -> None:
    error = CheckpointIntegrityError("Truncated payload /x")
    error.failures = {3: "kept"}

    def fail() -> None:
        raise error

    with pytest.raises(CheckpointIntegrityError) as info:
        run_phase(fail, "Verifying")
    assert info.value is error
    assert str(info.value) == "Truncated payload /x" and info.value.failures == {3: "kept"}


def test_run_phase_wraps_foreign_exception_with_context_and_cause() -> None:
    cause = ValueError("boom on disk")

    def fail() -> None:
        raise cause

    with pytest.raises(CheckpointRankError) as info:
        run_phase(fail, "Saving the model into /ckpt")
    assert str(info.value) == "Saving the model into /ckpt failed: ValueError: boom on disk"
    assert info.value.__cause__ is cause
    assert info.value.failures == {0: "ValueError: boom on disk"}


def test_run_phase_names_foreign_exception_type_when_message_is_empty() -> None:
    def fail() -> None:
        raise KeyError

    with pytest.raises(CheckpointRankError, match=r"^Loading failed: KeyError$"):
        run_phase(fail, "Loading")


def test_run_phase_passes_base_exceptions_through_unchanged() -> None:
    def interrupt() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_phase(interrupt, "Saving")


def test_agree_is_a_no_op_without_process_group() -> None:
    assert agree({"path": "/a", "hooks": [1, 2]}, "the checkpoint path") is None
    assert agree(object(), "a value that is not even JSON") is None


def test_on_main_returns_the_value() -> None:
    assert on_main(lambda: ["rank", 0], "Choosing") == ["rank", 0]


def test_on_main_raises_like_run_phase() -> None:
    def fail() -> None:
        raise OSError("disk full")

    with pytest.raises(CheckpointRankError, match=r"^Publishing /ckpt failed: OSError: disk full$"):
        on_main(fail, "Publishing /ckpt")


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_class_pickles_with_message_and_failures(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, CheckpointError)
    error = cls("what, where, fix")
    error.failures = {0: "ValueError: a", 3: "OSError: b"}
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == "what, where, fix"
    assert copy.failures == {0: "ValueError: a", 3: "OSError: b"}


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_class_starts_with_no_failures(name: str) -> None:
    assert getattr(errors, name)("message").failures == {}


def test_error_classes_subclass_the_documented_builtins() -> None:
    assert issubclass(errors.CheckpointError, RuntimeError)
    assert issubclass(errors.CheckpointIntegrityError, ValueError)
    assert issubclass(errors.CheckpointConfigurationError, ValueError)
    assert issubclass(errors.CheckpointExistsError, FileExistsError)
    assert issubclass(errors.NoCheckpointError, FileNotFoundError)
    assert issubclass(errors.NonFiniteStateError, ValueError)
