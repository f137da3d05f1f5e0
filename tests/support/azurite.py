"""A real Azure Blob Storage server on loopback for the tests: Azurite (Microsoft's emulator, the npm package
``azurite``), installed by the tests themselves with npm into ``.azurite/`` of the repository (git-ignored, kept
between runs; only node and npm must be on the machine), started on 127.0.0.1 on a free port with in-memory
storage, one per test session, and stopped at its end.

The client reaches it only through the standard Azure environment (``AZURE_STORAGE_CONNECTION_STRING`` with
Azurite's well-known development account, set here for the session and inherited by launched ranks), as a user's
would. Azurite's own access log (one line per request, written when it answers) is kept in order, for tests that
check the order of requests.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
AZURITE_VERSION = "3.37.0"
#: Where the tests install Azurite (git-ignored; ``AZURITE_DIR`` overrides it).
INSTALL_DIR = Path(os.environ.get("AZURITE_DIR") or REPO / ".azurite")
#: Azurite's well-known development account (public, documented by Microsoft; it guards nothing).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "accelerate-txn-tests"
LISTENING = re.compile(r"listens on (http://127\.0\.0\.1:\d+)")
_REQUEST = re.compile(r'"(GET|PUT|POST|DELETE|HEAD) (/\S*) HTTP/[0-9.]+" (\d+)')
#: Seconds to wait for npm and for Azurite to start: hang guards, not synchronisation.
INSTALL_TIMEOUT = 240
START_TIMEOUT = 60


@dataclass
class Azurite:
    """The loopback server and every request it answered, in the order it answered them."""

    endpoint: str = ""
    connection_string: str = ""
    requests: list[tuple[str, str, int]] = field(default_factory=list)  # (method, path with query, status)
    output: list[str] = field(default_factory=list)
    exited: bool = False
    changed: threading.Condition = field(default_factory=threading.Condition)

    def settled(self) -> list[tuple[str, str, int]]:
        """Every request answered so far, once the log has caught up: a marker request is sent and awaited in the
        log (the server answers one connection's requests in order, and logs each when it answers it)."""
        from azure.storage.blob import BlobServiceClient

        marker = f"log-marker-{uuid.uuid4().hex}"
        client = BlobServiceClient.from_connection_string(self.connection_string)
        try:
            client.get_blob_client(CONTAINER, marker).get_blob_properties()
        except Exception:
            pass
        with self.changed:
            if not self.changed.wait_for(lambda: any(marker in path for _, path, _ in self.requests), timeout=60):
                raise AssertionError(f"Azurite never logged the marker request {marker}")
            return [request for request in self.requests if marker not in request[1]]


def azurite_binary() -> Path:
    """``azurite-blob`` of Azurite ``AZURITE_VERSION``, installed with npm under :data:`INSTALL_DIR` if it is not
    there yet (a lock keeps two test sessions from installing at once)."""
    from filelock import FileLock

    binary = INSTALL_DIR / "node_modules" / ".bin" / "azurite-blob"
    package = INSTALL_DIR / "node_modules" / "azurite" / "package.json"
    INSTALL_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(str(INSTALL_DIR / ".install.lock"), timeout=INSTALL_TIMEOUT):
        if binary.exists() and f'"version": "{AZURITE_VERSION}"' in package.read_text():
            return binary
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError("The Azure tests need node and npm (to install Azurite, the Azure Storage emulator); "
                               "install Node.js 18 or newer")
        result = subprocess.run([npm, "install", "--prefix", str(INSTALL_DIR), "--no-audit", "--no-fund",
                                 "--ignore-scripts", "--no-save", f"azurite@{AZURITE_VERSION}"],
                                capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
        if result.returncode != 0 or not binary.exists():
            raise RuntimeError(f"npm could not install azurite@{AZURITE_VERSION} into {INSTALL_DIR}:\n"
                               f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return binary


def _read_log(process: subprocess.Popen[str], server: Azurite) -> None:
    """Reads Azurite's output to its end: the line saying where it listens, then one line per request answered."""
    assert process.stdout is not None
    for line in process.stdout:
        with server.changed:
            server.output.append(line)
            found = _REQUEST.search(line)
            if found:
                server.requests.append((found.group(1), found.group(2), int(found.group(3))))
            elif server.endpoint == "" and (listening := LISTENING.search(line)):
                server.endpoint = listening.group(1)
                server.connection_string = (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
                                            f"BlobEndpoint={server.endpoint}/{ACCOUNT};")
            server.changed.notify_all()
    with server.changed:
        server.exited = True
        server.changed.notify_all()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    binary = azurite_binary()
    workspace = tmp_path_factory.mktemp("azurite")
    process = subprocess.Popen(
        [str(binary), "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence", "--disableTelemetry",
         "--skipApiVersionCheck"],
        cwd=workspace, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        server = Azurite()
        threading.Thread(target=_read_log, args=(process, server), daemon=True).start()
        with server.changed:
            if not server.changed.wait_for(lambda: server.endpoint or server.exited, timeout=START_TIMEOUT) or (
                    not server.endpoint):
                raise RuntimeError(f"Azurite did not start: {''.join(server.output)[-3000:]}")
        connection = server.connection_string
        with pytest.MonkeyPatch.context() as env:
            for name in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
                env.delenv(name, raising=False)
            env.setenv("AZURE_STORAGE_CONNECTION_STRING", connection)
            from azure.storage.blob import BlobServiceClient

            BlobServiceClient.from_connection_string(connection).create_container(CONTAINER)
            yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
