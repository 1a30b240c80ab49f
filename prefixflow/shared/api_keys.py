"""API keys -> tenants.

Two places, read at start-up and merged:

- a keys file (`--api-keys-file`, `PFX_API_KEYS_FILE`; mode 0600): one `TENANT KEY` per
  line, the tenant, white space, then the key: the rest of the line, so a key may hold
  any printable ASCII character (`#`, `,`, `:`, `'`, `"`, `\\`, and spaces inside; white
  space around it is not part of it, as HTTP trims a header's value). Blank lines and
  lines whose first character (after white space) is `#` are comments. A line without
  white space is read the older way, `tenant:key`. `prefixflow cluster config --tenant`
  writes this file for the head node (`api-keys`).
- `--api-keys` (`PFX_API_KEYS`): `tenant:key,tenant:key` for simple keys: items split at
  commas (and new lines), each at its first `:`; `#` is an ordinary character. A key
  with a comma goes in the file (env files have their own quoting rules besides: honcho's
  `.env` cuts an unquoted value at `#`, systemd's `EnvironmentFile=` eats backslashes;
  a file of keys has none).

A tenant name becomes a key-value key token and a directory name, so it is checked like
a job id; a key maps to one tenant (a tenant may have several, e.g. while rotating). No
key configured: one tenant, `default`, and no key is asked (a local cluster); the
service logs that it runs open. Error messages never show a key.

Keys change without a restart (`KeyRing`): the keys file is read again when it changes
(checked at every request: `prefixflow/shared/process/watched.py`), so a key added to it
works and a key removed from it (revoked, or rotated out) is refused (401) from the next
request on. An edit that does not parse keeps the keys in force (and logs why); a service
started with keys never runs open, even if every key is removed.
"""

from __future__ import annotations

from pathlib import Path

from prefixflow.shared.wire.subjects import name_problem

OPEN_TENANT = "default"


def key_problem(key: str) -> str | None:
    """Why `key` cannot be an API key (None: it can): printable ASCII only, since HTTP
    carries header values as bytes (anything else may reach the server otherwise encoded
    than configured)."""
    if not key:
        return "empty key"
    if any(not (" " <= c <= "~") for c in key):
        return "a key is printable ASCII characters only"
    if key != key.strip():
        return "a key cannot begin or end with a space"
    return None


def _add(keys: dict[str, str], tenant: str, key: str, where: str) -> None:
    if (problem := name_problem(tenant)) is not None:
        raise ValueError(f"{where}: tenant {tenant!r}: {problem} (letters, digits, '-' and '_')")
    if (problem := key_problem(key)) is not None:
        raise ValueError(f"{where}: tenant {tenant!r}: {problem}")
    if keys.get(key, tenant) != tenant:
        raise ValueError(f"{where}: one API key given to two tenants ({keys[key]}, {tenant})")
    keys[key] = tenant


def parse_keys(text: str) -> dict[str, str]:
    """{key: tenant} from `--api-keys`: 'tenant:key' items separated by commas or new
    lines. Raises ValueError on a bad item, a bad tenant name or a key given twice."""
    keys: dict[str, str] = {}
    for n, raw in enumerate(text.replace(",", "\n").split("\n"), 1):
        item = raw.strip()
        if not item:
            continue
        tenant, sep, key = item.partition(":")
        if not sep or not tenant.strip() or not key.strip():
            raise ValueError(f"--api-keys item {n} ({tenant.strip()!r}...): want 'tenant:key'")
        _add(keys, tenant.strip(), key.strip(), f"--api-keys item {n}")
    return keys


def parse_keys_file(text: str, name: str = "keys file") -> dict[str, str]:
    """{key: tenant} from a keys file's text: `TENANT KEY` lines (`tenant:key` lines
    without white space too). Raises ValueError naming the line."""
    keys: dict[str, str] = {}
    for n, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()  # NOTE: `str.strip` also drops a CRLF file's "\r"
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) == 2:
            tenant, key = parts[0], parts[1].strip()
        else:
            tenant, sep, key = line.partition(":")
            if not sep:
                raise ValueError(f"{name} line {n}: want 'TENANT KEY'")
        _add(keys, tenant, key, f"{name} line {n}")
    return keys


def render_keys_file(keys: dict[str, str]) -> str:
    """A keys file (`parse_keys_file`) for {tenant: key}."""
    keys_file: dict[str, str] = {}
    for tenant, key in keys.items():
        _add(keys_file, tenant, key, "API keys")
    lines = ["# TENANT KEY: one API key per line (the rest of the line is the key).",
             *(f"{tenant} {key}" for tenant, key in keys.items())]
    return "\n".join(lines) + "\n"


def load_keys(inline: str, path: str) -> dict[str, str]:
    keys = parse_keys(inline)
    if path:
        for key, tenant in parse_keys_file(Path(path).read_text(), path).items():
            _add(keys, tenant, key, path)
    return keys


class KeyRing:
    """The API keys in force: `--api-keys` (fixed) merged with the keys file (read again
    when it changes). Raises ValueError/OSError at start for bad keys or an unreadable file."""

    def __init__(self, inline: str, path: str) -> None:
        from prefixflow.shared.process.watched import Watched

        self.inline = parse_keys(inline)
        self.file = Watched(path, lambda text: self._merge(parse_keys_file(text, path), path), "API keys") if path else None
        self.open = not self.keys()
        """No key at start: one open tenant, no key asked (never switched on later)."""

    def _merge(self, from_file: dict[str, str], path: str) -> dict[str, str]:
        keys = dict(self.inline)
        for key, tenant in from_file.items():
            _add(keys, tenant, key, path)
        return keys

    def keys(self) -> dict[str, str]:
        """{key: tenant} in force now."""
        return self.file.get() if self.file is not None else self.inline

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of a request's `Authorization` header (None: refused)."""
        if self.open:
            return OPEN_TENANT
        keys = self.keys()
        return tenant_of(keys, authorization) if keys else None


def tenant_of(keys: dict[str, str], authorization: str | None) -> str | None:
    """The tenant of an `Authorization: Bearer <key>` header; None if it names none.
    With no keys configured every request is the open tenant's."""
    if not keys:
        return OPEN_TENANT
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return keys.get(key.strip())
