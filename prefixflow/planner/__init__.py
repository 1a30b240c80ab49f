"""`prefixflow plan`: a job's wall time, GPU-hours and cost on fleets, predicted before it
runs (docs/plan.md) -- the input sampled and tokenized (`sample`), simulated with the
product's own decisions (`prefixflow.sim`), `--calibrate` fitting this machine first
(`calibrate`), printed (`predict`)."""
