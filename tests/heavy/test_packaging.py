"""`pip install --no-deps .` into a fresh virtualenv adds only `prefixflow` and its
dist-info at the top of site-packages (issue 41, must-show 3): no `shared`, `client`,
`cli`, ... colliding with other packages of those names; and `import prefixflow` there
works without any dependency installed (its top level imports nothing of them).

Offline and fast: the checkout's package files are copied aside (a build writes `build/`
and `*.egg-info` beside them), built into a wheel by this environment's pip with its own
setuptools (`--no-build-isolation --no-index`: no registry), and that wheel installed by
the same pip into a venv made `--without-pip` (`pip --python`), which is what
`pip install .` does in two steps."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True, capture_output=True,
                   text=True)


def test_pip_install_adds_only_prefixflow_to_site_packages(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "prefixflow", src / "prefixflow", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    bare = {p.name for p in site.iterdir()}

    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp_path / "wheels"), str(src))
    wheel = next((tmp_path / "wheels").glob("prefixflow-*.whl"))
    pip("--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel))

    added = {p.name for p in site.iterdir()} - bare
    dist_info = [n for n in added if n.endswith(".dist-info")]
    assert added == {"prefixflow", *dist_info} and len(dist_info) == 1 and dist_info[0].startswith("prefixflow-"), added
    assert (site / "prefixflow" / "api" / "__init__.py").exists() and (site / "prefixflow" / "shared").is_dir()
    probe = ("import sys, prefixflow; print(prefixflow.__version__, "
             "sorted({m.split('.')[0] for m in sys.modules} & {'nats', 'pyarrow', 'msgspec'}))")
    out = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert out.strip().split(maxsplit=1) == [version, "[]"], "installed without its dependencies, it still imports"
