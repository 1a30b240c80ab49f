"""`prefixflow torture`: seeded simulation testing of the whole system on real processes
(docs/torture.md). Modules: `datasets` (what a round sends), `faults` (what it does to
the processes), `entries` (how the job goes in), `checkers` (the contract, on what came
out), `rounds` (a round's plan from its seed), `known` (failures that belong to other
work), `runner` (carrying it out), `commands` (the CLI)."""
