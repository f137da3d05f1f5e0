"""Fixtures shared by several test modules."""

from tests._s3_server import s3_server  # noqa: F401 (the loopback S3 server, one per session)
