"""A fleet on one machine, brought up the way README's "Running on several machines" says.

1. `prefixflow cluster config` writes each node's /etc/prefixflow/ (here a directory per
   node under the test's temporary directory).
2. Each node runs the units of `deploy/systemd/` as systemd would: the unit's ExecStart
   (its `%i`/`%l` expanded, `/opt/prefixflow/.venv` being this virtualenv and
   `/etc/prefixflow/` the node's directory), with the environment of its
   `EnvironmentFile=`s and `Environment=` lines and nothing else of ours.

Each node is its own "machine": a network namespace with its own address on a private
bridge (10.x.y.0/24), made by the test (`Lan`; needs root). Without root the nodes share
127.0.0.1 on distinct ports. Nothing leaves this machine either way.

With `private_disks` (root) each node also has its own disk: its processes run in a mount
namespace of their own where the other nodes' directories (config, store, working
directory), the people's `clients/` configs, a local output root and any `hide`d path (the
test's input) are empty read-only mounts, and the model's path is the node's own copy, as
when every machine has its own disk with the model at the same path.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefixflow.launch.local_cluster import free_port, wait_replicas_ready
from prefixflow.shared.bus.connection import NatsOptions

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
UNITS = REPO / "deploy" / "systemd"
INSTALL_BIN = "/opt/prefixflow/.venv/bin/"
ETC = "/etc/prefixflow/"


# --- systemd units -------------------------------------------------------------------


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections of a unit file -> its (key, value) lines, in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        if current is None or "=" not in line:
            raise ValueError(f"{path.name}: not a unit line: {raw!r}")
        key, value = line.split("=", 1)
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def expand(value: str, instance: str = "", host: str = "") -> str:
    """The specifiers our units use: %i (instance), %l (short host name), %%."""
    return value.replace("%%", "\0").replace("%i", instance).replace("%l", host).replace("\0", "%")


def exec_argv(path: Path, key: str = "ExecStart", instance: str = "", host: str = "") -> list[str]:
    (line,) = values(parse_unit(path), "Service", key)
    return shlex.split(expand(line.lstrip("-@:+!"), instance, host))


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, value = line.split("=", 1)
        env[key.strip()] = value.strip().strip('"')
    return env


def unit_env(path: Path, etc: Path, instance: str = "", host: str = "") -> dict[str, str]:
    """The environment systemd gives the unit: its EnvironmentFile=s (read from `etc`
    instead of /etc/prefixflow/), then its Environment= lines."""
    unit = parse_unit(path)
    env: dict[str, str] = {}
    for f in values(unit, "Service", "EnvironmentFile"):
        optional = f.startswith("-")
        f = expand(f.lstrip("-"), instance, host)
        local = Path(f.replace(ETC, f"{etc}/", 1))
        if local.exists() or not optional:
            env.update(read_env_file(local))
    for line in values(unit, "Service", "Environment"):
        for assignment in shlex.split(expand(line, instance, host)):
            key, value = assignment.split("=", 1)
            env[key] = value
    return env


def localize(argv: list[str], etc: Path) -> list[str]:
    """The unit's command on this machine: our virtualenv, the node's config directory,
    and no metrics server (the units' fixed ports would collide between nodes sharing
    127.0.0.1, and with anything else on this machine)."""
    out = []
    for a in argv:
        if a.startswith(INSTALL_BIN):
            a = str(VENV_BIN / a[len(INSTALL_BIN):])
        if out and out[-1] == "--metrics-port":
            a = "0"
        out.append(a.replace(ETC, f"{etc}/"))
    return out


# --- network namespaces --------------------------------------------------------------


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


def netns_available() -> bool:
    if os.geteuid() != 0:
        return False
    name = f"pfxprobe{os.getpid()}"
    try:
        sh("ip", "netns", "add", name)
        sh("ip", "netns", "del", name)
        return True
    except (OSError, subprocess.SubprocessError):
        return False


class Lan:
    """A private bridge in this namespace and one namespace per node on it, each with
    its own address (10.a.b.i/24; this namespace is 10.a.b.254, so the test reaches
    every node). Unique names and subnet per test run; torn down in `down()`."""

    def __init__(self, nodes: int) -> None:
        self.tag = f"{os.getpid() % 100000:05d}{random.randrange(36 ** 2):03x}"[-7:]
        self.bridge = f"pf{self.tag}b"
        self.ns = [f"pfx-{self.tag}-n{i + 1}" for i in range(nodes)]
        self.veths = [f"pf{self.tag}v{i + 1}" for i in range(nodes)]
        taken = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        while True:
            self.net = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
            if f"{self.net}." not in taken:
                break
        self.addrs = [f"{self.net}.{i + 1}" for i in range(nodes)]
        self.bridge_addr = f"{self.net}.254"
        """This namespace's address on the bridge (every node reaches it)."""

    def up(self) -> Lan:
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            sh("ip", "addr", "add", f"{self.net}.254/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for ns, veth, addr in zip(self.ns, self.veths, self.addrs):
                sh("ip", "netns", "add", ns)
                sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                sh("ip", "link", "set", veth, "master", self.bridge, "up")
                sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", "eth0")
                sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
                sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        except Exception:
            self.down()
            raise
        return self

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[i]]

    def down(self) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


# --- the fleet -----------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    restart_sec: float = 0.1
    """The unit's RestartSec= (systemd's default: 100 ms)."""
    popen: subprocess.Popen | None = None
    starts: list[float] = field(default_factory=list)
    exits: list[tuple[float, int]] = field(default_factory=list)
    """(monotonic time seen, exit code) of every exit."""

    def start(self, cwd: Path) -> None:
        with open(self.log, "ab") as f:
            self.popen = subprocess.Popen(self.argv, env=self.env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts.append(time.monotonic())

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)  # type: ignore[union-attr]


def restart_sec(path: Path) -> float:
    (value,) = values(parse_unit(path), "Service", "RestartSec") or ["0.1"]
    return float(value.removesuffix("s"))


def clean_env() -> dict[str, str]:
    """What systemd starts a unit with, roughly: no PFX_* of ours leaks in."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PFX_")}


class Fleet:
    """`nodes` nodes, each a nats-server of one JetStream cluster; services are added
    per node with `service()`."""

    def __init__(self, workdir: Path, nodes: int = 3, *, tls: dict[str, Path] | None = None, no_tls: bool = False,
                 model: Path | None = None, netns: bool | None = None, head: int = -1,
                 tenants: tuple[str, ...] = (), out_root: str | None = None, private_disks: bool = False,
                 hide: tuple[Path, ...] = ()) -> None:
        self.workdir = workdir
        self.n = nodes
        self.tls = tls
        """Certificates to give `cluster config` (None: it makes its own, unless `no_tls`)."""
        self.no_tls = no_tls
        self.tenants = tenants
        """`cluster config --tenant` for each: clients/tenant-<name>.env."""
        self.head = head % nodes
        """The node that runs the ingestor, router, sink and API (`--head`): the last."""
        self.model = model
        self.lan = Lan(nodes) if (netns_available() if netns is None else netns) else None
        self.names = [f"nats-{i + 1}" for i in range(nodes)]
        self.etc_root = workdir / "etc"
        self.out_root = workdir / "out"
        self.out_uri = out_root
        """The sink's output root as given (a URI: an object store; None: `out_root`)."""
        self.private_disks = private_disks
        if private_disks and self.lan is None:
            raise RuntimeError("private disks need root (mount namespaces), as network namespaces do")
        self.hide = hide
        self.procs: dict[str, Proc] = {}
        self.node_of: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.supervisor = threading.Thread(target=self.supervise_forever, daemon=True)
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        (workdir / "var").mkdir(parents=True, exist_ok=True)

    # 1. configuration ----------------------------------------------------------------

    def config_argv(self) -> list[str]:
        """The `prefixflow cluster config` command line (README step 1)."""
        if self.lan is not None:
            hosts = ",".join(self.lan.addrs)
            listen = []
        else:
            hosts = ",".join(f"127.0.0.1:{free_port()}:{free_port()}:0" for _ in range(self.n))
            listen = ["--listen-host", "127.0.0.1"]
        argv = [
            str(VENV_BIN / "prefixflow"), "cluster", "config", "--out", str(self.etc_root), "--hosts", hosts, *listen,
            "--store-dir", str(self.workdir / "var" / "{node}" / "nats"), "--out-root", self.out_uri or str(self.out_root),
            "--etc-dir", str(self.etc_root / "{node}"), "--head", self.names[self.head],
        ]
        for tenant in self.tenants:
            argv += ["--tenant", tenant]
        if self.no_tls:
            argv.append("--no-tls")
        elif self.tls:
            argv += ["--tls-cert", str(self.tls["cert"]), "--tls-key", str(self.tls["key"]), "--tls-ca", str(self.tls["ca"])]
        if self.model:
            argv += ["--model", str(self.model)]
        return argv

    def start(self, timeout: float = 60) -> Fleet:
        if self.lan is not None:
            self.lan.up()
        try:
            subprocess.run(self.config_argv(), check=True, capture_output=True, text=True, timeout=60)
            self.out_root.mkdir(parents=True, exist_ok=True)
            for i in range(self.n):
                self.home(i).mkdir(parents=True, exist_ok=True)
                if self.private_disks and self.model is not None:
                    shutil.copytree(self.model, self.home(i) / "model", dirs_exist_ok=True)
            for i in range(self.n):
                self.start_server(i)
            self.wait_servers(timeout)
            self.provision()
            self.supervisor.start()
        except BaseException:
            self.stop()
            raise
        return self

    def etc(self, i: int) -> Path:
        return self.etc_root / self.names[i]

    def home(self, i: int) -> Path:
        """Node i's /var/lib/prefixflow: its units' working directory, its store."""
        return self.workdir / "var" / self.names[i]

    def hidden(self, i: int) -> list[Path]:
        """What node i's processes see as empty directories (`private_disks`)."""
        others = [p for j in range(self.n) if j != i for p in (self.etc(j), self.home(j))]
        local_out = [self.out_root] if self.out_uri is None or "://" not in self.out_uri else []
        return [*others, self.etc_root / "clients", *local_out, *self.hide]

    def disk(self, i: int) -> list[str]:
        """The command prefix giving node i's processes their own view of the disk."""
        mounts = [f"mount -t tmpfs -o ro,size=4k,mode=0555 pfx-not-on-this-node {shlex.quote(str(p))}"
                  for p in self.hidden(i)]
        if self.model is not None:
            mounts.append(f"mount --bind {shlex.quote(str(self.home(i) / 'model'))} {shlex.quote(str(self.model))}")
        script = " && ".join([*mounts, 'exec "$@"'])
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, f"disk-{self.names[i]}"]

    def provision(self) -> None:
        """README step: the operator creates the streams and buckets (`prefixflow cluster
        provision` with clients/env and clients/admin.env); the services may not."""
        res = subprocess.run([str(VENV_BIN / "prefixflow"), "cluster", "provision"], env=self.cli_env(self.head, "admin"),
                             capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"cluster provision failed:\n{res.stdout}\n{res.stderr}")

    def prefix(self, i: int) -> list[str]:
        """How a command runs on node i: in its network namespace, on its own disk."""
        net = self.lan.prefix(i) if self.lan is not None else []
        return net + (self.disk(i) if self.private_disks else [])

    # 2. units ------------------------------------------------------------------------

    def start_server(self, i: int) -> None:
        """prefixflow-nats.service on node i: ExecStartPre (config check), ExecStart."""
        unit = UNITS / "prefixflow-nats.service"
        env = {**clean_env(), **unit_env(unit, self.etc(i))}
        check = localize(exec_argv(unit, "ExecStartPre"), self.etc(i))
        subprocess.run(self.prefix(i) + check, check=True, capture_output=True, env=env, timeout=30)
        argv = self.prefix(i) + localize(exec_argv(unit), self.etc(i))
        name = self.names[i]
        proc = Proc(name, argv, env, self.workdir / "logs" / f"{name}.log", restart_sec(unit))
        with self.lock:
            self.procs[name] = proc
            self.node_of[name] = i
            proc.start(self.home(i))

    def wait_servers(self, timeout: float) -> None:
        """Every server up, and the JetStream cluster has a meta leader."""
        deadline = time.monotonic() + timeout
        for name in self.names:
            while b"Server is ready" not in self.procs[name].log.read_bytes():
                if not self.procs[name].alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start:\n{self.tail(name)}")
                time.sleep(0.1)
        if self.n > 1:
            while not any(b"metadata leader" in self.procs[n].log.read_bytes() for n in self.names):
                if time.monotonic() > deadline:
                    raise RuntimeError("no JetStream meta leader:\n" + self.tail(self.names[0]))
                time.sleep(0.1)

    def service(self, unit_name: str, i: int, instance: str = "", env: dict[str, str] | None = None) -> Proc:
        """Start `deploy/systemd/<unit_name>` on node i (the node's name is its host name)."""
        unit = UNITS / unit_name
        host = self.names[i]
        argv = self.prefix(i) + localize(exec_argv(unit, instance=instance, host=host), self.etc(i))
        full_env = {**clean_env(), **unit_env(unit, self.etc(i), instance, host), **(env or {})}
        base = unit_name.removeprefix("prefixflow-").removesuffix(".service").replace("@", "")
        name = f"{base}{instance}@{host}"
        proc = Proc(name, argv, full_env, self.workdir / "logs" / f"{name}.log", restart_sec(unit))
        with self.lock:
            self.procs[name] = proc
            self.node_of[name] = i
            proc.start(self.home(i))
        return proc

    def api(self, i: int, port: int, timeout: float = 60) -> Proc:
        """prefixflow-api.service on node i, listening on the node's address at `port`;
        returns once it is ready (its base URL: `api_url`)."""
        proc = self.service("prefixflow-api.service", i, env={"PFX_HOST": self.address(i), "PFX_PORT": str(port)})
        deadline = time.monotonic() + timeout
        while "api ready" not in proc.log.read_text(errors="replace"):
            if proc.exits or not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the batch API did not start:\n{self.tail(proc.name)}")
            time.sleep(0.1)
        return proc

    def api_url(self, i: int, port: int) -> str:
        return f"http://{self.address(i)}:{port}/v1"

    # 3. clients ----------------------------------------------------------------------

    def env(self, i: int, role: str) -> dict[str, str]:
        """The environment of `role` on node i: a service's (the node's env and its env
        file: `engine-worker-0`, `bucketer`, ...), or a person's (`admin`, `submitter`,
        `tenant-<name>`: from clients/, on no node)."""
        if role in ("admin", "submitter") or role.startswith("tenant-"):
            clients = self.etc_root / "clients"
            return {**read_env_file(clients / "env"), **read_env_file(clients / f"{role}.env")}
        return {**read_env_file(self.etc(i) / "env"), **read_env_file(self.etc(i) / f"{role}.env")}

    def address(self, i: int) -> str:
        """Node i's own address (where a process on it listens for the others)."""
        return self.lan.addrs[i] if self.lan is not None else "127.0.0.1"

    def url(self, i: int) -> str:
        """Node i's URL list (its own server first)."""
        return read_env_file(self.etc(i) / "env")["PFX_NATS_URL"]

    def options(self, role: str, i: int = 0) -> NatsOptions:
        return NatsOptions.from_env(self.env(i, role))

    def cli_env(self, i: int, role: str = "submitter") -> dict[str, str]:
        """A user's shell after `set -a; . clients/env; . clients/submitter.env`."""
        return {**clean_env(), **self.env(i, role)}

    # 4. faults and teardown ----------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL (the unit's Restart=always brings it back after its RestartSec)."""
        with self.lock:
            proc = self.procs[name]
            proc.signal(signal.SIGKILL)
            proc.popen.wait(10)  # type: ignore[union-attr]

    def supervise(self) -> None:
        """One round of systemd's `Restart=always`: a unit whose process exited is started
        again `RestartSec` later."""
        now = time.monotonic()
        with self.lock:
            for proc in self.procs.values():
                if proc.popen is None or proc.popen.poll() is None:
                    continue
                if not proc.exits or proc.exits[-1][0] < proc.starts[-1]:
                    proc.exits.append((now, proc.popen.returncode))
                elif now - proc.exits[-1][0] >= proc.restart_sec:
                    proc.start(self.home(self.node_of[proc.name]))

    def supervise_forever(self) -> None:
        while not self.stopping.wait(0.05):
            self.supervise()

    def restarts(self) -> dict[str, int]:
        return {name: len(p.starts) - 1 for name, p in self.procs.items() if len(p.starts) > 1}

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.procs[name].log
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def check_alive(self) -> None:
        """During start-up: any exit is a failure (not something to restart)."""
        for name, proc in self.procs.items():
            if proc.exits or not proc.alive():
                raise RuntimeError(f"{name} exited:\n{self.tail(name)}")

    def stop(self) -> None:
        self.stopping.set()
        if self.supervisor.is_alive():
            self.supervisor.join(5)
        services = [p for n, p in self.procs.items() if n not in self.names]
        servers = [p for n, p in self.procs.items() if n in self.names]
        for group in (services, servers):
            for p in group:
                p.signal(signal.SIGTERM)
            deadline = time.monotonic() + 15
            for p in group:
                while p.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
                if p.alive():
                    p.signal(signal.SIGKILL)
                if p.popen is not None:
                    p.popen.wait(10)
        if self.lan is not None:
            self.lan.down()


async def wait_ready(url: str, options: NatsOptions, replicas: list[str], timeout: float, alive=lambda: None) -> float:
    """Wait until every replica reports ready (status subject); seconds waited."""
    return await wait_replicas_ready(url, replicas, timeout, alive, options=options)
