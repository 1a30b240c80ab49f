"""prefixflow: distributed batch LLM inference with dynamic prefix bucketing over NATS
JetStream and vLLM.

Everything the distribution installs lives under this one package (nothing else goes to
the top of site-packages): the design card's folders one level down -- `services`
(ingestor, bucketer, router, engine-worker, sink), `shared` (wire, bus, prefix, process),
`client`, `batchapi`, `launch`, `datagen`, `report`, `sim`, `bench` -- and `cli`, the
`prefixflow` command (`prefixflow.cli.main:main`). A development checkout and an installed
package are the same tree. This module imports nothing of them, so importing one
subpackage loads only what it needs.

The Python API (`prefixflow.run`, `prefixflow.Client`, the typed errors: `prefixflow/api`)
is resolved on first use, as `__version__` is: `import prefixflow` stays light.
"""

from __future__ import annotations


API = ("Client", "ClusterError", "DirTaken", "InputError", "Job", "JobCancelled", "JobFailed", "JobMismatch",
       "JobPaused", "OptionError", "OutputConflict", "PrefixflowError", "Result", "run", "run_async")
"""The names of `prefixflow.api` that `prefixflow.<name>` gives."""
__all__ = list(API)


def __getattr__(name: str):
    """The Python API's names (imported on first use), and `__version__`, read from the
    installed distribution when first asked for."""
    if name in API:
        from prefixflow import api

        return getattr(api, name)
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("prefixflow")
        except PackageNotFoundError:  # a source tree that was never installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
