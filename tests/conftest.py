"""Fixtures shared by several test modules."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.azurite import azurite  # noqa: F401 (the loopback Azure Blob server, Azurite, one per session)
from tests.support.fakegcs import fake_gcs  # noqa: F401 (the loopback Google Cloud Storage server, one per session)
from tests.support.s3_server import s3_server  # noqa: F401 (the loopback S3 server, one per session)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Any:
    """The CLI run in this process: ``cli(*args)`` returns a ``tests.cli.test_cli.Result`` (exit code, stdout, stderr)
    and fails the test if stderr holds a traceback."""
    from accelerate_txn.cli import main
    from tests.cli.test_cli import Result

    def run(*args: Any) -> Result:
        code = main([str(arg) for arg in args])
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err, captured.err
        return Result(code, captured.out, captured.err)

    return run
