"""prefixflow: distributed batch LLM inference with dynamic prefix bucketing over NATS
JetStream and vLLM.

Everything the distribution installs lives under this one package (nothing else goes to
the top of site-packages): the design card's folders one level down -- `services`
(ingestor, bucketer, router, engine-worker, sink), `shared` (wire, bus, prefix, process),
`client`, `batchapi`, `launch`, `datagen`, `report`, `sim`, `bench` -- and `cli`, the
`prefixflow` command (`prefixflow.cli.main:main`). A development checkout and an installed
package are the same tree. This module imports nothing of them, so importing one
subpackage loads only what it needs.
"""

from __future__ import annotations


def __getattr__(name: str) -> str:
    """`__version__`, read from the installed distribution when first asked for."""
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("prefixflow")
        except PackageNotFoundError:  # a source tree that was never installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
