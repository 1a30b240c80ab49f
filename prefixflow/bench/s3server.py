"""A real S3 API server for the suite and `prefixflow bench s3`: moto's server mode
(`moto_server`, from PyPI: `make install` puts it in the virtualenv) on a loopback port (or
a test fleet's bridge address), with IAM authentication on, so wrong credentials are
refused as by S3.

`S3Server.start()` starts it, creates a user with a policy allowing everything and its
access key, a bucket, then turns authentication on (moto's `/moto-api/reset-auth`):
from then on only that key is accepted. `env` is what a client process needs (the AWS
SDK's standard variables, and no config file or instance metadata of this machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prefixflow.launch.local_cluster import free_port

VENV_BIN = Path(sys.executable).parent
"""Where `moto_server` is (this interpreter's virtualenv)."""
ALLOW_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


def stop_process(proc: subprocess.Popen | None) -> None:
    """SIGTERM a server process, SIGKILL if it has not exited 10 s later."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


class S3Server:
    def __init__(self, log: Path, bucket: str = "pfx-data", host: str = "127.0.0.1") -> None:
        """`host`: the address it listens on (a fleet's bridge address, for its nodes)."""
        self.port = free_port()
        self.host = host
        self.endpoint = f"http://{host}:{self.port}"
        self.bucket = bucket
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.key = self.secret = ""

    def start(self) -> S3Server:
        self.proc = subprocess.Popen([str(VENV_BIN / "moto_server"), "-H", self.host, "-p", str(self.port)],
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).read()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start:\n{self.log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.1)
        import boto3

        kw = {"endpoint_url": self.endpoint, "region_name": "us-east-1", "aws_access_key_id": "setup",
              "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="pfx")
        iam.put_user_policy(UserName="pfx", PolicyName="all", PolicyDocument=json.dumps(ALLOW_ALL))
        access = iam.create_access_key(UserName="pfx")["AccessKey"]
        self.key, self.secret = access["AccessKeyId"], access["SecretAccessKey"]
        boto3.client("s3", **kw).create_bucket(Bucket=self.bucket)
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=10).read()  # authentication on from here
        return self

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}

    def filesystem(self):
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(access_key=self.key, secret_key=self.secret, region="us-east-1",
                                 endpoint_override=self.endpoint)

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def stop(self) -> None:
        stop_process(self.proc)
