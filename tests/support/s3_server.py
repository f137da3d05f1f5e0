"""A real S3-protocol server on loopback for the tests: moto's ``ThreadedMotoServer`` on 127.0.0.1 on a free port,
one per test session, reached only through the standard AWS environment (``AWS_ENDPOINT_URL`` and credentials, set
here for the session and inherited by launched ranks), as a user's client would. The server's own request log is
kept, in the order it answered, for tests that check the order of requests."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from accelerate_txn.store.s3 import S3Store

BUCKET = "accelerate-txn-tests"
_REQUEST = re.compile(r"(GET|PUT|POST|DELETE|HEAD) (/\S*) HTTP/")  # lines may be wrapped in ANSI colours


@dataclass
class Server:
    """The loopback S3 server and every request it answered, in the order it answered them."""

    endpoint: str
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path with query)


class _RequestLog(logging.Handler):
    """Records werkzeug's access-log lines. werkzeug logs a request when it sends the response status, so a
    request the client waited for is recorded before the client's next request is sent."""

    def __init__(self, requests: list[tuple[str, str]]) -> None:
        super().__init__(logging.INFO)
        self.requests = requests

    def emit(self, record: logging.LogRecord) -> None:
        found = _REQUEST.search(record.getMessage())
        if found:
            self.requests.append((found.group(1), found.group(2)))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from moto.server import ThreadedMotoServer  # here: collecting the other tests imports no moto

    werkzeug = logging.getLogger("werkzeug")
    saved = werkzeug.level, werkzeug.propagate
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    requests: list[tuple[str, str]] = []
    handler = _RequestLog(requests)
    werkzeug.addHandler(handler)  # also keeps werkzeug from adding its own console handler
    werkzeug.setLevel(logging.INFO)
    werkzeug.propagate = False
    server.start()
    try:
        host, port = server.get_host_and_port()
        nowhere = tmp_path_factory.mktemp("aws") / "absent"  # no profile of the machine's user leaks in
        with pytest.MonkeyPatch.context() as env:
            for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                         "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
                env.delenv(name, raising=False)
            env.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
            env.setenv("AWS_ACCESS_KEY_ID", "accelerate-txn-test")
            env.setenv("AWS_SECRET_ACCESS_KEY", "accelerate-txn-test")
            env.setenv("AWS_DEFAULT_REGION", "us-east-1")
            env.setenv("AWS_CONFIG_FILE", str(nowhere))
            env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
            env.setenv("AWS_EC2_METADATA_DISABLED", "true")
            S3Store().fs.mkdir(BUCKET)
            yield Server(f"http://{host}:{port}", requests)
    finally:
        server.stop()
        werkzeug.removeHandler(handler)
        werkzeug.setLevel(saved[0])
        werkzeug.propagate = saved[1]
