"""A Google Cloud Storage emulator for the suite: `gcp-storage-emulator` (PyPI) on a
loopback port, in memory, with one bucket.

Two things make pyarrow's `GcsFileSystem` (google-cloud-cpp) work against it unchanged,
through the environment alone, the way a user's process would run against the real GCS:
- `CLOUD_STORAGE_EMULATOR_ENDPOINT` (google-cloud-cpp's emulator variable; the Python
  client's `STORAGE_EMULATOR_HOST` is not read by it);
- `GOOGLE_APPLICATION_CREDENTIALS`: a service account file made here with a new RSA key
  (the client signs its own token with it; nothing is exchanged with Google).
The emulator's HTTP server answers one request at a time, and pyarrow reads a file's
ranges on a second connection while the first still streams: it is started with a
threading server instead (a one-line wrapper below), or a ranged read waits forever.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prefixflow.bench.s3server import stop_process
from prefixflow.launch.local_cluster import free_port

THREADED = ("import http.server, sys; http.server.HTTPServer = http.server.ThreadingHTTPServer; "
            "from gcp_storage_emulator.__main__ import main; sys.exit(main(sys.argv[1:]))")


def service_account(path: Path) -> Path:
    """A service account key file of a made-up account with a new RSA key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "pfx-test", "private_key_id": "k1", "private_key": pem,
        "client_email": "pfx@pfx-test.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": "https://oauth2.googleapis.com/token",
    }))
    path.chmod(0o600)
    return path


class GcsServer:
    def __init__(self, workdir: Path, bucket: str = "pfx-data") -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.bucket = bucket
        self.workdir = workdir
        self.log = workdir / "gcs.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> GcsServer:
        self.credentials = service_account(self.workdir / "service-account.json")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", THREADED, "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory",
             "--default-bucket", self.bucket], stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{self.bucket}", timeout=1).read()
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the GCS emulator did not start:\n{self.log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.1)

    @property
    def env(self) -> dict[str, str]:
        return {"CLOUD_STORAGE_EMULATOR_ENDPOINT": self.endpoint, "GOOGLE_APPLICATION_CREDENTIALS": str(self.credentials)}

    def filesystem(self):
        import pyarrow.fs as pafs

        return pafs.GcsFileSystem(anonymous=True, endpoint_override=f"127.0.0.1:{self.port}", scheme="http")

    def uri(self, key: str) -> str:
        return f"gs://{self.bucket}/{key}"

    def stop(self) -> None:
        stop_process(self.proc)
