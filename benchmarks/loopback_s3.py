"""The loopback S3 server of the object-storage benchmarks (``bench_store.py``, ``bench_remote.py``).

moto's ``ThreadedMotoServer`` on 127.0.0.1 (a free port), started in a child process so that its Python request
handling does not share the interpreter lock with the client measured. Clients reach it only through the standard
AWS environment (:func:`loopback_s3` sets it in this process; launched ranks inherit it), as a user's would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_SERVER = """
import logging, sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the parent closes the pipe
server.stop()
"""


def start_server() -> tuple[subprocess.Popen[str], str]:
    """Start the server in a child process; returns it and its endpoint URL (``http://127.0.0.1:PORT``)."""
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert server.stdout is not None
    port = server.stdout.readline().strip()
    if not port:
        raise RuntimeError("the moto server did not start")
    return server, f"http://127.0.0.1:{port}"


def stop_server(server: subprocess.Popen[str]) -> None:
    assert server.stdin is not None
    server.stdin.close()
    server.wait(timeout=60)


def environment(endpoint: str) -> dict[str, str]:
    """The standard AWS variables that point a client at ``endpoint`` with dummy credentials."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true", "AWS_EC2_METADATA_DISABLED": "true"}


@contextmanager
def loopback_s3() -> Iterator[str]:
    """Start the server, point this process's AWS environment at it, yield the endpoint; stop it on exit."""
    server, endpoint = start_server()
    try:
        os.environ.update(environment(endpoint))
        yield endpoint
    finally:
        stop_server(server)
