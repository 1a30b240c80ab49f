"""What the benchmark harnesses share: the machine they ran on and how a report is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    import os
    import platform

    import vllm

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "vllm": vllm.__version__}


def write_report(report: dict[str, Any], json_path: str | None, plot_path: str | None = None, plot=None) -> None:
    """A benchmark's report as JSON (`--json`) and its plot (`--plot`), when asked for."""
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_path}")
    if plot_path and plot is not None:
        plot(report, plot_path)
        print(f"wrote {plot_path}")
