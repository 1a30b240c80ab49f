"""API keys -> tenants (`--api-keys 'alice:ka,bob:kb'`, or a file of `tenant:key` lines).

A tenant name becomes a key-value key token and a directory name, so it is checked
like a job id; a key maps to one tenant. No key configured: one tenant, `default`, and
no key is asked (a local cluster); the service logs that it runs open.
"""

from __future__ import annotations

from pathlib import Path

from prefixflow.shared.wire.subjects import name_problem

OPEN_TENANT = "default"


def parse_keys(text: str) -> dict[str, str]:
    """{key: tenant} from 'tenant:key' items, separated by commas or new lines (# starts
    a comment). Raises ValueError on a bad item, a bad tenant name or a key given twice."""
    keys: dict[str, str] = {}
    for raw in text.replace(",", "\n").splitlines():
        item = raw.split("#", 1)[0].strip()
        if not item:
            continue
        tenant, sep, key = item.partition(":")
        tenant, key = tenant.strip(), key.strip()
        if not sep or not tenant or not key:
            raise ValueError(f"API key item {item.split(':', 1)[0]!r}...: want 'tenant:key'")
        if (problem := name_problem(tenant)) is not None:
            raise ValueError(f"tenant {tenant!r}: {problem} (letters, digits, '-' and '_')")
        if key in keys and keys[key] != tenant:
            raise ValueError(f"one API key given to two tenants ({keys[key]}, {tenant})")
        keys[key] = tenant
    return keys


def load_keys(inline: str, path: str) -> dict[str, str]:
    keys = parse_keys(inline)
    if path:
        for key, tenant in parse_keys(Path(path).read_text()).items():
            if keys.get(key, tenant) != tenant:
                raise ValueError(f"one API key given to two tenants ({keys[key]}, {tenant})")
            keys[key] = tenant
    return keys


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
