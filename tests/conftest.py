"""Fixtures shared by several test modules."""

from tests._azurite import azurite  # noqa: F401 (the loopback Azure Blob server, Azurite, one per session)
from tests._s3_server import s3_server  # noqa: F401 (the loopback S3 server, one per session)
