"""`prefixflow cluster config`: the NATS configs and env files for a fleet of N nodes.

Every node of a fleet runs one nats-server (together a JetStream cluster), one bucketer
and one engine-worker per GPU (`--engines`); one node (`--head`) also runs the ingestor,
router, sink and batch API. For each node this writes a directory to copy to
`/etc/prefixflow/` on that machine, holding the secrets of the processes it runs and
nothing else:

    nats-server.conf     the node's server: client port, cluster routes, JetStream store,
                         TLS for clients and routes; includes users.conf
    users.conf           every NATS user with its password as a bcrypt hash (the server
                         checks passwords, it cannot tell them), and the route password
                         the servers use among themselves (secret, mode 0600); includes
                         permissions.conf
    permissions.conf     one permission block per user, generated from
                         `prefixflow.shared.wire.permissions` (itself built from `prefixflow.shared.wire.subjects`):
                         a bucketer and an engine-worker get grants of their own process
    ca.pem, server-cert.pem, server-key.pem (0600)
                         the CA and the node's certificate (TLS on unless `--no-tls`)
    env                  read by every unit: the server URLs (this node's own first),
                         the node's name, the CA, `PFX_PROVISION=false`
    bucketer.env, engine-worker-<GPU>.env, and on the head ingestor.env, router.env,
    sink.env, api.env    one process's NATS user and password (secret, mode 0600); those of the
                         bucketer, the router and the sink also hold the result key (PFX_RESULT_KEY)
    api-keys             on the head, with `--tenant`: the batch API's keys, one
                         `TENANT KEY` line per tenant (secret; api.env names it)

Apart from the nodes, for the operator's machine only: `<out>/clients/` (env, ca.pem,
admin.env, submitter.env, and tenant-<name>.env per `--tenant`: the users people use,
a tenant's with its batch API key as `OPENAI_API_KEY`), `<out>/ca/` (the CA's key) and
`<out>/secrets.json` (every password and API key, mode 0600; reused when the command runs
again, so adding a node does not change every password; set a tenant's key there, any
printable ASCII, to choose it). Paths may contain `{node}` (the node's
name), which lets several nodes share one machine (tests, trials).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
from pathlib import Path

import bcrypt

from prefixflow.shared.api_keys import key_problem, render_keys_file
from prefixflow.launch import fleet_pki
from prefixflow.launch.fleet_nats import HEADER, Node, User, render_permissions, render_server, render_users, tls_paths
from prefixflow.shared.outcomes import usage_error
from prefixflow.shared.wire.subjects import tenant_problem

DEFAULTS = {
    "client_port": 4222,
    "cluster_port": 6222,
    "monitor_port": 8222,
    "store_dir": "/var/lib/prefixflow/nats",
    "out_root": "/var/lib/prefixflow/out",
    "cluster_name": "prefixflow",
    "etc_dir": "/etc/prefixflow",
}
HEAD_ROLES = ("ingestor", "router", "sink", "api")
"""The processes of the head node (besides every node's bucketer and engine-workers)."""
CLIENT_ROLES = ("admin", "submitter")
"""Users for people and programs, written to `<out>/clients/`, on no node."""
BCRYPT_ROUNDS = 10
"""Cost of the servers' password check (once per connection)."""
API_KEYS_FILE = "api-keys"
"""The batch API's keys file on the head node (`prefixflow/shared/api_keys.py`)."""


def engine_instances(spec: str) -> list[str]:
    """`--engines`: the engine units' instances on every node (`0,1,2,3`, `0-3,4-7`)."""
    out = [part.strip() for part in spec.split(",") if part.strip()]
    if not out or len(set(out)) != len(out) or any(not all(c.isdigit() or c == "-" for c in p) for p in out):
        raise usage_error(f"--engines {spec!r}: want GPU indices or ranges, comma separated (0,1 or 0-3,4-7)")
    return out


def node_users(node: Node, head: str, engines: list[str]) -> list[User]:
    """The processes `node` runs, one user each."""
    users = [User("bucketer", node.name), *(User("engine-worker", f"{node.name}-gpu{i}") for i in engines)]
    if node.name == head:
        users += [User(role) for role in HEAD_ROLES]
    return users


def all_users(nodes: list[Node], head: str, engines: list[str], tenants: list[str] = ()) -> list[User]:
    return ([u for n in nodes for u in node_users(n, head, engines)] + [User(role) for role in CLIENT_ROLES]
            + [User("tenant", t) for t in tenants])


def parse_nodes(hosts: list[str], names: list[str] | None, args: argparse.Namespace) -> list[Node]:
    """`HOST` or `HOST:CLIENT_PORT:CLUSTER_PORT[:MONITOR_PORT]` per node."""
    if names and len(names) != len(hosts):
        raise usage_error(f"--names lists {len(names)} names for {len(hosts)} hosts")
    nodes = []
    for i, spec in enumerate(hosts):
        host, *ports = spec.split(":")
        if ports and len(ports) not in (2, 3):
            raise usage_error(f"{spec!r}: want HOST or HOST:CLIENT_PORT:CLUSTER_PORT[:MONITOR_PORT]")
        try:
            client, cluster, monitor = (
                [int(p) for p in ports] + ([args.monitor_port] if len(ports) == 2 else [])
                if ports
                else [args.client_port, args.cluster_port, args.monitor_port]
            )
        except ValueError:
            raise usage_error(f"{spec!r}: ports must be numbers") from None
        name = names[i] if names else f"nats-{i + 1}"
        nodes.append(Node(name, host, client, cluster, monitor))
    if len({n.name for n in nodes}) != len(nodes):
        raise usage_error("node names must be unique")
    return nodes


# --- env files (one per node, per process and per user) ---------------------------


def client_urls(node: Node | None, nodes: list[Node], tls: bool) -> str:
    """This node's own server first (None: in the given order): services connect to it
    and fail over to the rest."""
    scheme = "tls" if tls else "nats"
    ordered = nodes if node is None else [node] + [n for n in nodes if n != node]
    return ",".join(f"{scheme}://{n.host}:{n.client_port}" for n in ordered)


def files_uri(text: str) -> str:
    """`--files-uri`: an object store prefix (argparse's type check; "": none)."""
    from prefixflow.shared.outputs import OutputLocationError, object_prefix

    if not text:
        return text
    try:
        return object_prefix(text)
    except OutputLocationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def render_env(node: Node, nodes: list[Node], args: argparse.Namespace) -> str:
    tls = tls_paths(node, args)
    lines = [
        HEADER.rstrip(),
        f"# /etc/prefixflow/env on {node.name}: read by every prefixflow unit (every flag of",
        "# `prefixflow serve NAME` is also a PFX_* variable).",
        f"PFX_NATS_URL={client_urls(node, nodes, bool(tls))}",
        f"PFX_NODE={node.name}",
        "PFX_LOG_FORMAT=json",
        "# Streams and buckets are the operator's (`prefixflow cluster provision`): services only check them.",
        "PFX_PROVISION=false",
        "# Metrics (unauthenticated) on this node's own address only.",
        f"PFX_METRICS_HOST={node.host}",
    ]
    if tls:
        lines.append(f"PFX_NATS_TLS_CA={tls[2]}")
    if args.model:
        lines.append(f"PFX_MODEL={args.model}")
    if getattr(args, "files_uri", ""):
        lines += ["# The batch service's files (read by the api and the sink; their object store credentials",
                  "# go in api.env and sink.env).", f"PFX_FILES_URI={args.files_uri}"]
    return "\n".join(lines) + "\n"


def render_clients_env(nodes: list[Node], ca: str) -> str:
    lines = [HEADER.rstrip(), "# For people and programs (with admin.env or submitter.env): every server of the fleet.",
             f"PFX_NATS_URL={client_urls(None, nodes, bool(ca))}", "PFX_PROVISION=false"]
    if ca:
        lines.append(f"PFX_NATS_TLS_CA={ca}")
    return "\n".join(lines) + "\n"


RESULT_KEY_ROLES = ("bucketer", "router", "sink")
"""The roles that hold the fleet's result key: those that assign prompts to replicas, and
the sink that checks each result's grant (never an engine, a client or a tenant)."""


def render_user_env(u: User, password: str, node: Node | None, args: argparse.Namespace, *, api_key: str = "",
                    keys_file: str = "", result_key: str = "") -> str:
    """`api_key`: a tenant's batch API key; `keys_file`: the batch API's keys file (the
    api's env, on the head); `result_key`: the fleet's result key, written into the env of
    the roles that hold it (`RESULT_KEY_ROLES`) only."""
    what = f"the {u.role} {u.name}" if u.name else f"the {u.role}"
    lines = [HEADER.rstrip(), f"# Secret: the NATS user of {what}.", f"PFX_NATS_USER={u.user}", f"PFX_NATS_PASSWORD={password}"]
    if u.role == "engine-worker":
        lines.append(f"PFX_REPLICA={u.name}")
    if u.role == "sink" and node is not None:
        lines.append(f"PFX_OUT_ROOT={args.out_root.replace('{node}', node.name)}")
    if u.role == "admin":
        lines.append("PFX_PROVISION=true")
    if u.role in RESULT_KEY_ROLES and result_key:
        lines += ["# Signs and checks which replica may answer which prompt (prefixflow/shared/wire/provenance.py).",
                  f"PFX_RESULT_KEY={result_key}"]
    if u.role == "tenant":
        lines.append(f"PFX_TENANT={u.name}")
        if api_key:  # NOTE: this file is for a shell (`. tenant-NAME.env`): quoted for one
            lines += ["# The batch API's key of this tenant (the openai client reads it).",
                      f"OPENAI_API_KEY={shlex.quote(api_key)}"]
    if keys_file:
        # NOTE: keys travel in a file of their own, never in an env file: env file parsers
        # differ on `#`, quotes and backslashes (honcho, systemd), a key may hold any of them.
        lines += ["# The tenants' API keys: TENANT KEY lines (prefixflow/shared/api_keys.py).",
                  f"PFX_API_KEYS_FILE={keys_file}"]
    return "\n".join(lines) + "\n"


# --- writing -------------------------------------------------------------------------


def load_secrets(path: Path, users: list[User]) -> dict:
    """Passwords and tenants' API keys of an earlier run (kept), plus new ones for users
    that have none."""
    data = json.loads(path.read_text()) if path.exists() else {}
    passwords = data.get("users", {})
    for u in users:
        passwords.setdefault(u.user, secrets.token_urlsafe(24))
    api_keys = data.get("api_keys", {})
    for u in users:
        if u.role == "tenant":
            api_keys.setdefault(u.name, "pfx-" + secrets.token_urlsafe(32))
            if (problem := key_problem(api_keys[u.name])) is not None:
                raise usage_error(f"{path}: api_keys of {u.name!r}: {problem}")
    return {"users": passwords, "route": data.get("route") or secrets.token_urlsafe(24), "api_keys": api_keys,
            "result_key": data.get("result_key") or secrets.token_hex(32)}


def write(path: Path, text: str | bytes, secret: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
    os.chmod(tmp, 0o600 if secret else 0o644)
    tmp.replace(path)


def generate(args: argparse.Namespace) -> list[Path]:
    """Write every node's directory under `args.out`; returns the node directories."""
    if args.no_tls and args.tls_cert:
        raise usage_error("--no-tls and --tls-cert contradict each other")
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_cert and not args.tls_ca):
        raise usage_error("TLS needs --tls-cert, --tls-key and --tls-ca together")
    hosts = args.hosts.split(",") if args.hosts else [f"nats-{i + 1}" for i in range(args.nodes)]
    nodes = parse_nodes([h.strip() for h in hosts if h.strip()], args.names.split(",") if args.names else None, args)
    head = args.head or nodes[0].name
    if head not in {n.name for n in nodes}:
        raise usage_error(f"--head {head!r} is none of the nodes ({', '.join(n.name for n in nodes)})")
    engines = engine_instances(args.engines)
    tenants = list(dict.fromkeys(args.tenant or []))
    for t in tenants:
        if (problem := tenant_problem(t)) is not None:
            raise usage_error(f"--tenant {t!r}: {problem}")
    users = all_users(nodes, head, engines, tenants)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    secret = load_secrets(out / "secrets.json", users)
    write(out / "secrets.json", json.dumps(secret, indent=1) + "\n", secret=True)
    hashes = {u.user: bcrypt.hashpw(secret["users"][u.user].encode(), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()
              for u in users}
    perms = render_permissions(users)
    users_conf = render_users(hashes, users, secret["route"], nodes)
    generated_tls = not args.no_tls and not args.tls_cert
    if generated_tls:
        ca_pem, ca_key = fleet_pki.load_or_make_ca(out / "ca", args.cluster_name)
        write(out / "ca" / "ca.pem", ca_pem)
        write(out / "ca" / "ca-key.pem", ca_key, secret=True)
    clients = out / "clients"
    client_ca = ""
    if generated_tls:
        client_ca = str((clients / "ca.pem").resolve())
        write(clients / "ca.pem", ca_pem)
    elif args.tls_cert:
        client_ca = args.tls_ca.replace("{node}", nodes[0].name)
    write(clients / "env", render_clients_env(nodes, client_ca))
    api_keys = {t: secret["api_keys"][t] for t in tenants}
    for u in [User(role) for role in CLIENT_ROLES] + [User("tenant", t) for t in tenants]:
        write(clients / u.env_file, render_user_env(u, secret["users"][u.user], None, args,
                                                    api_key=api_keys.get(u.name, "")), secret=True)
    dirs = []
    for node in nodes:
        d = out / node.name
        for old in [*d.glob("*.env"), d / API_KEYS_FILE] if d.exists() else ():  # what this node no longer runs
            old.unlink(missing_ok=True)
        write(d / "nats-server.conf", render_server(node, nodes, args))
        write(d / "permissions.conf", perms)
        write(d / "users.conf", users_conf, secret=True)
        write(d / "env", render_env(node, nodes, args))
        if generated_tls:
            cert, key = fleet_pki.node_certificate(ca_pem, ca_key, node.name, [node.host])
            write(d / "ca.pem", ca_pem)
            write(d / "server-cert.pem", cert)
            write(d / "server-key.pem", key, secret=True)
        keys_file = f"{args.etc_dir.replace('{node}', node.name).rstrip('/')}/{API_KEYS_FILE}" if api_keys else ""
        for u in node_users(node, head, engines):
            write(d / u.env_file, render_user_env(u, secret["users"][u.user], node, args,
                                                  keys_file=keys_file if u.role == "api" else "",
                                                  result_key=secret["result_key"]), secret=True)
        if node.name == head and api_keys:
            write(d / API_KEYS_FILE, render_keys_file(api_keys), secret=True)
        dirs.append(d)
    return dirs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "config",
        help="write the NATS configs and env files for N nodes",
        description="Write, per node, the nats-server config (cluster, JetStream, one user per "
        "process with its own permissions, TLS with a generated CA unless --no-tls or given "
        "certificates) and the env files of the processes that node runs. Copy <out>/<node>/ to "
        "/etc/prefixflow/ on that node; <out>/clients/ holds the admin and submitter users.",
    )
    p.add_argument("--out", required=True, help="output directory (one subdirectory per node; secrets.json)")
    p.add_argument("--nodes", type=int, default=3, help="number of nodes when --hosts is not given (hosts nats-1..N; default 3)")
    p.add_argument(
        "--hosts",
        default="",
        help="comma-separated addresses of the nodes, each HOST or HOST:CLIENT_PORT:CLUSTER_PORT[:MONITOR_PORT]",
    )
    p.add_argument("--names", default="", help="comma-separated node (server) names (default nats-1..N)")
    p.add_argument("--head", default="", help="the node that also runs the ingestor, router, sink and batch API "
                   "(default: the first)")
    p.add_argument("--tenant", action="append", metavar="NAME",
                   help="add a tenant (repeatable): clients/tenant-NAME.env, a user that may submit and follow "
                   "only its own jobs (ids NAME.JOB); keep the flags when running the command again")
    p.add_argument("--engines", default="0", help="engine units on every node, by GPU instance: 0,1,2,3 or 0-3,4-7 "
                   "(tensor parallel) (default 0); one NATS user each")
    p.add_argument("--listen-host", default="0.0.0.0", help="address the servers listen on (default 0.0.0.0)")
    p.add_argument("--client-port", type=int, default=DEFAULTS["client_port"], help="client port (default 4222)")
    p.add_argument("--cluster-port", type=int, default=DEFAULTS["cluster_port"], help="route port (default 6222)")
    p.add_argument("--monitor-port", type=int, default=DEFAULTS["monitor_port"], help="monitoring port on 127.0.0.1 (0: none; default 8222)")
    p.add_argument("--cluster-name", default=DEFAULTS["cluster_name"], help="JetStream cluster name")
    p.add_argument("--store-dir", default=DEFAULTS["store_dir"], help="JetStream store on each node ({node} allowed)")
    p.add_argument("--out-root", default=DEFAULTS["out_root"], help="the sink's output roots, comma-separated: a local directory ({node} allowed) and/or object store prefixes (s3://bucket/prefix)")
    p.add_argument("--etc-dir", default=DEFAULTS["etc_dir"],
                   help="where each node's directory is installed ({node} allowed; default /etc/prefixflow)")
    p.add_argument("--no-tls", action="store_true", help="no TLS (passwords, prompts and outputs cross the network in clear)")
    p.add_argument("--tls-cert", default="", help="server certificate on each node ({node} allowed), instead of "
                   "the generated ones: TLS for clients and routes")
    p.add_argument("--tls-key", default="", help="the certificate's key on each node")
    p.add_argument("--tls-ca", default="", help="CA certificate that signed the servers' certificates (clients and servers verify with it)")
    p.add_argument("--model", default="", help="PFX_MODEL for every node (the model directory on the nodes)")
    p.add_argument("--files-uri", default="", type=files_uri,
                   help="the batch service's files in an object store prefix (s3://bucket/prefix) instead of the NATS "
                        "object store (PFX_FILES_URI for the api and the sink)")
    p.set_defaults(fn=cmd_cluster_config)


def cmd_cluster_config(args: argparse.Namespace) -> None:
    dirs = generate(args)
    print(f"wrote {len(dirs)} node configs under {args.out} (passwords in {Path(args.out) / 'secrets.json'}):")
    for d in dirs:
        print(f"  {d}/  ->  /etc/prefixflow/ on {d.name}")
    print(f"  {Path(args.out) / 'clients'}/  ->  operators (admin.env) and submitters (submitter.env), on no node")
    print("next: on each node `systemctl start prefixflow-nats`; then, as admin, `prefixflow cluster provision`; "
          "then the services (README: Running on several machines)")


def add_parsers(sub) -> None:
    """`prefixflow cluster ...` subcommands."""
    from prefixflow.launch.fleet_provision import add_provision_parser

    add_parser(sub)
    add_provision_parser(sub)
