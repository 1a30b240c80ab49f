"""`prefixflow simulate`: the cluster at 8-1024 GPUs with the product's own bucketing and
routing code, simulated engines and a fitted cost model (docs/simulator.md).

    prefixflow simulate --shape seed --replicas 128                  the reference table, reproduced
    prefixflow simulate --shape zipf --scaling 8,16,...,1024         scaling curves
    prefixflow simulate --input DATA.parquet --replicas 64 --profile h100-8b
    prefixflow simulate --calibrate OUT_DIR:64 --save-profile cpu.json --predict OTHER_DIR:48
    prefixflow simulate --input prompts.parquet --output-lens 16,96 --write-input mixed.parquet
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from prefixflow.shared.outcomes import usage_error

SHAPES = ("seed", "zipf", "hierarchical", "prefix-repetition")
KNOBS = {
    "buffer-prompts": ("bucketer", "buffer_prompts", int),
    "min-bucket": ("bucketer", "min_bucket", int),
    "pool-size": ("bucketer", "pool_size", int),
    "eager-delay": ("bucketer", "eager_delay", float),
    "window": ("worker", "window", int),
    "load-slack-tokens": ("router", "load_slack_tokens", int),
    "history": ("router", "history", int),
    "cap-windows": ("router", "cap_windows", float),
    "start-windows": ("router", "start_windows", float),
    "lead-seconds": ("router", "lead_seconds", float),
    "kv-admission": ("worker", "kv_admission", lambda v: v.lower() in ("1", "true", "on", "yes")),
    "kv-output-reserve": ("worker", "kv_output_reserve", float),
    "split-factor": ("router", "split_factor", float),
    "hot-factor": ("router", "hot_factor", float),
    "nodes": ("", "nodes", int),
}
"""Product settings `--sweep` varies: (part of `prefixflow.sim.cluster.Options`, field, type)."""


def add_parser(sub) -> None:
    from prefixflow.sim.cluster import DEFAULT_METHODS, METHODS
    from prefixflow.sim.cost import PROFILES

    p = sub.add_parser("simulate", help="simulate the cluster at 8-1024 GPUs with the product's own bucketing and routing")
    src = p.add_argument_group("workload")
    src.add_argument("--input", help="Parquet/JSONL with prompt_token_ids (or prompt, tokenized with --model) and optionally output_len")
    src.add_argument("--shape", choices=SHAPES, default=None, help="a generated shape (default seed without --input)")
    src.add_argument("--scale", type=float, default=1.0, help="shrink a generated shape: prompts and prefixes x this")
    src.add_argument("--num-prompts", type=int, default=0)
    src.add_argument("--prefix-len", type=int, default=256)
    src.add_argument("--suffix-len", type=int, default=256)
    src.add_argument("--num-prefixes", type=int, default=0)
    src.add_argument("--output-len", type=int, default=128)
    src.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of --shape zipf")
    src.add_argument("--seed", type=int, default=0)
    src.add_argument("--model", default=None, help="tokenizer for a prompt column (default: the local tiny model)")
    src.add_argument("--adapters", type=int, default=0,
                     help="spread the prompts over this many LoRA adapters (prompt i under adapter i mod N; "
                          "an --input's own `lora` column otherwise)")
    p.add_argument("--max-loras", type=int, default=0, help="LoRA adapters an engine runs at once (0: no limit)")
    p.add_argument("--replicas", type=int, default=128)
    p.add_argument("--profile", default="l4-8b", help=f"{', '.join(PROFILES)}, or a JSON file (--calibrate --save-profile)")
    p.add_argument("--kv-blocks", type=int, default=0, help="override the profile's KV blocks per replica")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"],
                   help="a memory scenario for every method: vLLM's KV cache dtype (fp8 halves a token's KV bytes: "
                        "twice the blocks, half the context reads; GPU profiles)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="a memory scenario for every method: vLLM's share of GPU memory (default 0.9; the KV cache "
                        "gets what is left after the weights and activations; GPU profiles)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--nodes", type=int, default=0, help="bucketer nodes (default: replicas / the profile's GPUs per node)")
    p.add_argument("--buffer-prompts", type=int, default=0, help="bucketer buffer bound (default: the bucketer's)")
    p.add_argument("--window", type=int, default=0, help="engine-worker --window (default: the worker's)")
    p.add_argument("--load-slack-tokens", type=int, default=-1, help="router --load-slack-tokens (default: the router's)")
    p.add_argument("--history", type=int, default=0, help="router --history (default: the router's)")
    p.add_argument("--cap-windows", type=float, default=0, help="router --cap-windows (default: the router's)")
    p.add_argument("--split-factor", type=float, default=0, help="router --split-factor (default: the router's)")
    p.add_argument("--stagger", default="", metavar="LO,HI",
                   help="replicas ready at staggered times, evenly spread over LO..HI seconds (a real fleet: 30,120) "
                   "instead of all at the profile's start-up")
    p.add_argument("--window-probe", action="store_true",
                   help="simulate the worker's adaptive window with its first-result probe (window.Window): a fresh engine "
                   "runs one prompt alone first; use it to predict real runs made with it")
    p.add_argument("--sweep", metavar="KNOB=V1,V2,...", action="append", default=[],
                   help=f"run --methods at --replicas once per value of a product knob, the others at their defaults "
                   f"(repeatable; knobs: {', '.join(KNOBS)}); prints a table, --json writes it")
    p.add_argument("--scaling", default="", help="replica counts for scaling curves, e.g. 8,16,32,64,128,256,512,1024")
    p.add_argument("--scaling-methods", default="daft,prefix-aware", help="methods of the scaling curves")
    p.add_argument("--fit-seed", action="store_true", help="fit speed and sort overhead to the published naive and sorted rows (128 GPUs) and print them")
    p.add_argument("--calibrate", metavar="OUT_DIR[:KV]", action="append", default=[],
                   help="fit the profile to a real `prefixflow run` output directory (repeatable; :KV its --kv-cache-blocks, "
                   "else --kv-blocks); best a run with several output lengths (--output-lens)")
    p.add_argument("--predict", metavar="OUT_DIR[:KV]", action="append", default=[], help="predict a real run (repeatable) and print the errors")
    p.add_argument("--output-lens", default="", help="with --input and --write-input: give the rows these output lengths "
                   "(per-row sampling max_tokens = min_tokens, as many rows of each), e.g. 16,96")
    p.add_argument("--write-input", metavar="FILE", help="write --input with --output-lens per row to FILE and stop (a calibration dataset)")
    p.add_argument("--run-policy", default="prefix-aware", help="the policy the real runs used (--calibrate/--predict)")
    p.add_argument("--save-profile", help="write the (calibrated) profile here")
    p.add_argument("--jobs", type=int, default=0, help="parallel simulations (default: the cores)")
    p.add_argument("--json", help="write the report here (a `methods` list as `bench methods` writes)")
    p.add_argument("--plot", help="write a PNG: wall time and hit rate per method, scaling curves")
    p.set_defaults(fn=cmd_simulate)


def options(args):
    import msgspec

    from prefixflow.shared.process.config import BucketerConfig, EngineWorkerConfig, RouterConfig
    from prefixflow.sim.cluster import Options

    b, r, w = BucketerConfig(), RouterConfig(), EngineWorkerConfig(engine="vllm")
    if args.buffer_prompts:
        b = msgspec.structs.replace(b, buffer_prompts=args.buffer_prompts)
    if args.window:
        w = msgspec.structs.replace(w, window=args.window)
    if args.load_slack_tokens >= 0:
        r = msgspec.structs.replace(r, load_slack_tokens=args.load_slack_tokens)
    if args.history:
        r = msgspec.structs.replace(r, history=args.history)
    if args.cap_windows:
        r = msgspec.structs.replace(r, cap_windows=args.cap_windows)
    if args.split_factor:
        r = msgspec.structs.replace(r, split_factor=args.split_factor)
    nodes = args.nodes
    real_runs = args.calibrate or args.predict  # `prefixflow run`: one bucketer
    if not nodes and real_runs:
        nodes = 1
    if not nodes and not real_runs and not args.input and (args.shape or "seed") == "seed":
        from prefixflow.sim.seed import REFERENCE_NODES

        nodes = REFERENCE_NODES
    stagger = None
    if args.stagger:
        try:
            lo, hi = (float(x) for x in args.stagger.split(","))
        except ValueError:
            raise usage_error(f"--stagger {args.stagger!r}: want LO,HI seconds, e.g. 30,120") from None
        if not 0 <= lo <= hi:
            raise usage_error(f"--stagger {args.stagger!r}: want 0 <= LO <= HI")
        stagger = (lo, hi)
    return Options(bucketer=b, router=r, worker=w, nodes=nodes, window_probe=args.window_probe, stagger=stagger,
                   max_loras=args.max_loras)


def workload(args):
    wl = shape_workload(args)
    return wl.with_adapters(args.adapters) if args.adapters else wl


def shape_workload(args):
    from prefixflow.sim import workload as W

    if args.input:
        return W.from_file(args.input, model=args.model, output_len=args.output_len)
    shape = args.shape or "seed"
    if shape == "seed":
        return W.seed_shape(args.scale, args.seed)
    if shape == "zipf":
        return W.zipf_shape(args.scale, args.seed, args.zipf)
    if shape == "hierarchical":
        return W.hierarchical_shape(args.scale, args.seed)
    n = args.num_prompts or round(200_000 * args.scale)
    return W.prefix_repetition(num_prompts=n, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                               num_prefixes=args.num_prefixes or 512, output_len=args.output_len, seed=args.seed)


def cmd_simulate(args: argparse.Namespace) -> None:
    from prefixflow.sim import seed
    from prefixflow.sim.cost import load_profile, with_memory
    from prefixflow.sim.runner import plot, print_rows, run_many, write_json

    profile = with_memory(load_profile(args.profile), args.gpu_memory_utilization, args.kv_cache_dtype)
    if args.kv_blocks:
        profile.kv_blocks = args.kv_blocks
    opts = options(args)
    if args.write_input:
        from prefixflow.sim.calibrate import with_output_lengths

        if not args.input or not args.output_lens:
            raise usage_error("--write-input needs --input and --output-lens")
        lens = [int(x) for x in args.output_lens.split(",") if x.strip()]
        counts = with_output_lengths(args.input, args.write_input, lens, args.seed)
        print(f"wrote {args.write_input}: " + ", ".join(f"{n} rows of {k} output tokens" for k, n in counts.items()))
        return
    if args.calibrate or args.predict:
        calibrate_and_predict(args, profile, opts)
        return
    t0 = time.perf_counter()
    wl = workload(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    is_seed = args.input is None and (args.shape or "seed") == "seed" and args.scale == 1 and args.replicas == 128
    print(f"workload {wl.name}: {len(wl)} prompts, {wl.total_prompt_tokens()} prompt tokens; profile {profile.name} "
          f"({profile.kv_blocks} KV blocks of {profile.block_size}); {args.replicas} replicas", flush=True)
    if args.fit_seed:
        fit_seed(args, wl, profile, opts)
        return
    if args.sweep:
        sweep(args, wl, profile, opts, methods)
        return
    jobs = [(wl, m, args.replicas, profile, opts) for m in methods]
    scaling_ns = [int(x) for x in args.scaling.split(",") if x.strip()]
    scaling_methods = [m.strip() for m in args.scaling_methods.split(",") if m.strip()] if scaling_ns else []
    if is_seed and not scaling_ns and "daft" in methods:
        scaling_ns, scaling_methods = [seed.SCALING_BASE, 64], ["daft"]  # 128 is in the table
    for m in scaling_methods:
        for n in scaling_ns:
            if not (n == args.replicas and m in methods):
                jobs.append((wl, m, n, profile, opts))
    rows = run_many(jobs, args.jobs)
    table = rows[: len(methods)]
    curves: dict[str, dict[str, dict]] = {}
    for row in rows[len(methods) :] + [r for r in table if r["method"] in scaling_methods]:
        curves.setdefault(row["method"], {})[str(row["replicas"])] = row
    from prefixflow.sim.cluster import replica_ready_times
    from prefixflow.sim.limit import workload_limit

    limit = workload_limit(wl, profile, args.replicas, replica_ready_times(profile, opts, args.replicas))
    for r in table:
        r["vs_limit"] = round(r["wall_seconds"] / limit.wall_seconds, 4)
    print()
    print_rows(table, seed.PUBLISHED if is_seed else None, limit.wall_seconds)
    report = {
        "title": f"{wl.name}, {args.replicas} x {profile.name}",
        "workload": {"name": wl.name, "prompts": len(wl), **wl.meta},
        "replicas": args.replicas,
        "profile": asdict(profile),
        "limit": limit.row(),
        "methods": table,
        "sim_seconds": round(time.perf_counter() - t0, 1),
    }
    naive = next((r for r in table if r["method"] == "naive"), None)
    for r in table:
        r["vs_naive"] = round(naive["wall_seconds"] / r["wall_seconds"], 3) if naive else None
    if curves:
        report["scaling"] = curves
        print("\nscaling (wall seconds):")
        for m, curve in curves.items():
            ns = sorted(int(n) for n in curve)
            print(f"  {m:>14}: " + "  ".join(f"{n}: {curve[str(n)]['wall_seconds']:.0f}" for n in ns))
            if seed.SCALING_BASE in ns:
                eff = seed.efficiency({n: curve[str(n)]["wall_seconds"] for n in ns})
                report.setdefault("efficiency", {})[m] = {str(n): round(e, 3) for n, e in eff.items()}
                print(f"  {'efficiency':>14}: " + "  ".join(f"{n}: {e:.2f}" for n, e in sorted(eff.items())))
    if is_seed:
        report["published"] = seed.PUBLISHED
        eff = report.get("efficiency", {}).get("daft", {})
        checks = seed.check({r["method"]: r for r in table}, {int(n): e for n, e in eff.items()})
        report["tolerances"] = [{"check": c, "met": ok, "detail": d} for c, ok, d in checks]
        print("\nagainst the published table:")
        for c, ok, d in checks:
            print(f"  [{'ok' if ok else 'MISSED'}] {c}: {d}")
        pa = next((r for r in table if r["method"] == "prefix-aware"), None)
        if pa:
            print(f"  prefix-aware: {pa['wall_seconds']:.0f} s, {seed.PUBLISHED['daft'][0] / pa['wall_seconds']:.2f}x the published bucketing (482 s)")
    print(f"\n({report['sim_seconds']} s of simulation)")
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    if args.plot:
        pub = seed.PUBLISHED if is_seed else {}
        plot(report | {"published": pub}, args.plot)
        print(f"wrote {args.plot}")


def with_knob(opts, knob: str, value: str):
    """`opts` with one product knob (`KNOBS`) set."""
    import dataclasses

    import msgspec

    if knob not in KNOBS:
        raise usage_error(f"unknown knob {knob!r}: one of {', '.join(KNOBS)}")
    part, name, kind = KNOBS[knob]
    if not part:
        return dataclasses.replace(opts, **{name: kind(value)})
    return dataclasses.replace(opts, **{part: msgspec.structs.replace(getattr(opts, part), **{name: kind(value)})})


def sweep(args, wl, profile, opts, methods: list[str]) -> None:
    """One-knob-at-a-time sweeps around the current settings (the defaults plus any
    knob flags given), each value run for every method at --replicas."""
    from prefixflow.sim import seed
    from prefixflow.sim.runner import run_many, write_json

    settings = [("current", "", opts)]
    for spec in args.sweep:
        knob, _, values = spec.partition("=")
        for v in (x.strip() for x in values.split(",") if x.strip()):
            settings.append((f"{knob}={v}", knob, with_knob(opts, knob, v)))
    jobs = [(wl, m, args.replicas, profile, o) for _, _, o in settings for m in methods]
    t0 = time.perf_counter()
    rows = run_many(jobs, args.jobs)
    out = []
    print(f"\n{'setting':>28} {'method':>14} {'wall s':>9} {'vs current':>10} {'vs 482 s':>9} {'hit':>7} {'busy':>6} {'split':>6} {'preempted':>9}")
    base = {r["method"]: r["wall_seconds"] for r in rows[: len(methods)]}
    for k, (label, knob, _) in enumerate(settings):
        for r in rows[k * len(methods) : (k + 1) * len(methods)]:
            r = r | {"setting": label, "knob": knob, "vs_current": round(base[r["method"]] / r["wall_seconds"], 4),
                     "vs_published_bucketing": round(seed.PUBLISHED["daft"][0] / r["wall_seconds"], 4)}
            out.append(r)
            print(f"{label:>28} {r['method']:>14} {r['wall_seconds']:9.1f} {r['vs_current']:9.3f}x {r['vs_published_bucketing']:8.3f}x "
                  f"{r['hit_rate']:7.1%} {r['busy_fraction']:6.1%} {r['groups_split']:6d} {r['preemptions']:9d}")
    print(f"\n({time.perf_counter() - t0:.0f} s of simulation)")
    if args.json:
        write_json(args.json, {"title": f"{wl.name}, {args.replicas} x {profile.name}: sweeps", "workload": {"name": wl.name, **wl.meta},
                               "replicas": args.replicas, "profile": asdict(profile), "sweeps": out})
        print(f"wrote {args.json}")


def fit_seed(args, wl, profile, opts) -> None:
    from prefixflow.sim import seed
    from prefixflow.sim.runner import run_many

    p = type(profile).from_dict(asdict(profile))
    p.speed, p.sort_s_per_1k = 1.0, 0.0
    rows = run_many([(wl, m, 128, p, opts) for m in seed.FIT_ROWS], args.jobs)
    walls = {r["method"]: r["wall_seconds"] for r in rows}
    speed, sort_s = seed.fit(walls, p.startup_s)
    print("speed 1: " + ", ".join(f"{m} {w:.1f} s" for m, w in walls.items()))
    print(f"fitted: speed = {speed:.4f}, sort overhead = {sort_s:.1f} s -> sort_s_per_1k = {sort_s / (len(wl) / 1000):.4f}")


def run_spec(spec: str, default_kv: int) -> tuple[str, int]:
    """OUT_DIR[:KV_BLOCKS]."""
    out, sep, kv = spec.rpartition(":")
    if sep and kv.isdigit():
        return out, int(kv)
    if not default_kv:
        raise usage_error(f"{spec}: give its KV blocks (OUT_DIR:KV) or --kv-blocks")
    return spec, default_kv


def calibrate_and_predict(args, profile, opts) -> None:
    from prefixflow.sim.calibrate import calibrate, coefficients, compare, read_run

    report: dict = {"profile_before": asdict(profile), "policy": args.run_policy}
    ok_all = True
    if args.calibrate:
        specs = [run_spec(s, args.kv_blocks) for s in args.calibrate]
        runs = [read_run(out, args.model) for out, _ in specs]
        profile, detail = calibrate(runs, [kv for _, kv in specs], profile, args.run_policy, opts)
        coef = coefficients(profile)
        print(f"calibrated on {', '.join(out for out, _ in specs)} ({detail['replays']} replays, completion-curve RMSE {detail['rmse_s']} s):")
        print(f"  c0 {1e3 * coef['c0']:.3f} ms/step, c_pf {1e6 * coef['c_pf']:.1f} us/prefill token, "
              f"c_dec {1e6 * coef['c_dec']:.1f} us/decoding request, c_ctx {1e6 * coef['c_ctx']:.3f} us/context token; "
              f"start-up {profile.startup_s:.3f} s, tail {profile.tail_s:.3f} s")
        report["calibration"] = detail | {"runs": [compare(profile, r, kv, args.run_policy, opts) for r, (_, kv) in zip(runs, specs)]}
        for c in report["calibration"]["runs"]:
            print(f"  fitted back {c['run']}: {c['predicted_wall_seconds']:.2f} s vs {c['measured_wall_seconds']:.2f} s "
                  f"({c['wall_error']:+.1%}), hit {c['predicted_hit_rate']:.1%} vs {c['measured_hit_rate']:.1%}")
        if args.save_profile:
            profile.save(args.save_profile)
            print(f"wrote {args.save_profile}")
    report["profile"] = asdict(profile)
    report["predictions"] = []
    for spec in args.predict:
        out, kv = run_spec(spec, args.kv_blocks)
        c = compare(profile, read_run(out, args.model), kv, args.run_policy, opts)
        c["wall_within_15pct"] = abs(c["wall_error"]) <= 0.15
        c["hit_within_3_points"] = abs(c["hit_error_points"]) <= 3
        ok_all &= c["wall_within_15pct"] and c["hit_within_3_points"]
        report["predictions"].append(c)
        print(f"predicted {out} ({c['prompts']} prompts, outputs {c['output_lens']}, {kv} KV blocks): wall {c['predicted_wall_seconds']:.2f} s "
              f"vs measured {c['measured_wall_seconds']:.2f} s ({c['wall_error']:+.1%}, {'ok' if c['wall_within_15pct'] else 'MISSED'} ±15%); "
              f"hit {c['predicted_hit_rate']:.1%} vs {c['measured_hit_rate']:.1%} ({c['hit_error_points']:+.1f} points, "
              f"{'ok' if c['hit_within_3_points'] else 'MISSED'} ±3)")
        print(f"  engine alone (the run's own feeding replayed, closed loop): span {c['engine_span_replayed_s']:.2f} s vs "
              f"{c['engine_span_measured_s']:.2f} s ({c['engine_replay_error']:+.1%}), first prompt in an engine at "
              f"{c['predicted_first_start_s']:.2f} s vs {c['measured_first_start_s']:.2f} s")
    if args.predict:
        report["all_within_bounds"] = ok_all
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
