"""The Python API: prefixflow jobs from notebooks and pipelines (README "Python API").

    import prefixflow

    result = prefixflow.run(table, out="out/", engine="echo", max_tokens=16)  # a local cluster
    result.to_arrow()

    with prefixflow.Client("nats://127.0.0.1:4222") as client:               # a running cluster
        job = client.submit(df, out="out2/", max_tokens=16)
        job.wait().to_arrow()

`prefixflow.<name>` resolves each name below lazily (`prefixflow/__init__.py`), so
`import prefixflow` loads none of NATS, pyarrow or vLLM.
"""

from __future__ import annotations

from prefixflow.api.jobs import Client, Job, Result
from prefixflow.api.local import run, run_async
from prefixflow.client.sources import InputError
from prefixflow.client.endings import DirTaken, JobCancelled, JobFailed, JobMismatch, JobPaused, OutputConflict
from prefixflow.shared.outcomes import ClusterError, OptionError, PrefixflowError

__all__ = ["Client", "ClusterError", "DirTaken", "InputError", "Job", "JobCancelled", "JobFailed", "JobMismatch",
           "JobPaused", "OptionError", "OutputConflict", "PrefixflowError", "Result", "run", "run_async"]
