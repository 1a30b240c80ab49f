"""`prefixflow simulate`: the cluster at 8-1024 GPUs with the product's own bucketing and
routing code, simulated engines and a fitted cost model (docs/simulator.md).

    prefixflow simulate --shape seed --replicas 128                  the reference table, reproduced
    prefixflow simulate --shape zipf --scaling 8,16,...,1024         scaling curves
    prefixflow simulate --input DATA.parquet --replicas 64 --profile h100-8b
    prefixflow simulate --calibrate OUT_DIR --kv-blocks 128 --save-profile cpu.json
    prefixflow simulate --predict OUT_DIR --kv-blocks 128 --profile cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

SHAPES = ("seed", "zipf", "prefix-repetition")


def add_parser(sub) -> None:
    from sim.cluster import DEFAULT_METHODS, METHODS
    from sim.cost import PROFILES

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
    p.add_argument("--replicas", type=int, default=128)
    p.add_argument("--profile", default="l4-8b", help=f"{', '.join(PROFILES)}, or a JSON file (--calibrate --save-profile)")
    p.add_argument("--kv-blocks", type=int, default=0, help="override the profile's KV blocks per replica")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--nodes", type=int, default=0, help="bucketer nodes (default: replicas / the profile's GPUs per node)")
    p.add_argument("--buffer-prompts", type=int, default=0, help="bucketer buffer bound (default: the bucketer's)")
    p.add_argument("--window", type=int, default=0, help="engine-worker --window (default: the worker's)")
    p.add_argument("--load-slack-tokens", type=int, default=-1, help="router --load-slack-tokens (default: the router's)")
    p.add_argument("--history", type=int, default=0, help="router --history (default: the router's)")
    p.add_argument("--cap-windows", type=float, default=0, help="router --cap-windows (default: the router's)")
    p.add_argument("--scaling", default="", help="replica counts for scaling curves, e.g. 8,16,32,64,128,256,512,1024")
    p.add_argument("--scaling-methods", default="daft,prefix-aware", help="methods of the scaling curves")
    p.add_argument("--fit-seed", action="store_true", help="fit speed and sort overhead to the published naive and sorted rows (128 GPUs) and print them")
    p.add_argument("--calibrate", metavar="OUT_DIR", help="fit the profile to a real `prefixflow run` output directory")
    p.add_argument("--predict", metavar="OUT_DIR", action="append", default=[], help="predict a real run (repeatable) and print the errors; OUT_DIR:KV_BLOCKS when its --kv-cache-blocks differ from --kv-blocks")
    p.add_argument("--run-policy", default="prefix-aware", help="the policy the real runs used (--calibrate/--predict)")
    p.add_argument("--save-profile", help="write the (calibrated) profile here")
    p.add_argument("--jobs", type=int, default=0, help="parallel simulations (default: the cores)")
    p.add_argument("--json", help="write the report here (a `methods` list as `bench methods` writes)")
    p.add_argument("--plot", help="write a PNG: wall time and hit rate per method, scaling curves")
    p.set_defaults(fn=cmd_simulate)


def options(args):
    import msgspec

    from shared.process.config import BucketerConfig, EngineWorkerConfig, RouterConfig
    from sim.cluster import Options

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
    nodes = args.nodes
    if not nodes and not args.input and (args.shape or "seed") == "seed":
        from sim.seed import REFERENCE_NODES

        nodes = REFERENCE_NODES
    return Options(bucketer=b, router=r, worker=w, nodes=nodes)


def workload(args):
    from sim import workload as W

    if args.input:
        return W.from_file(args.input, model=args.model, output_len=args.output_len)
    shape = args.shape or "seed"
    if shape == "seed":
        return W.seed_shape(args.scale, args.seed)
    if shape == "zipf":
        return W.zipf_shape(args.scale, args.seed, args.zipf)
    n = args.num_prompts or round(200_000 * args.scale)
    return W.prefix_repetition(num_prompts=n, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                               num_prefixes=args.num_prefixes or 512, output_len=args.output_len, seed=args.seed)


def cmd_simulate(args: argparse.Namespace) -> None:
    from sim import seed
    from sim.cost import load_profile
    from sim.runner import plot, print_rows, run_many, write_json

    profile = load_profile(args.profile)
    if args.kv_blocks:
        profile.kv_blocks = args.kv_blocks
    opts = options(args)
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
    print()
    print_rows(table, seed.PUBLISHED if is_seed else None)
    report = {
        "title": f"{wl.name}, {args.replicas} x {profile.name}",
        "workload": {"name": wl.name, "prompts": len(wl), **wl.meta},
        "replicas": args.replicas,
        "profile": asdict(profile),
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


def fit_seed(args, wl, profile, opts) -> None:
    from sim import seed
    from sim.runner import run_many

    p = type(profile).from_dict(asdict(profile))
    p.speed, p.sort_s_per_1k = 1.0, 0.0
    rows = run_many([(wl, m, 128, p, opts) for m in seed.FIT_ROWS], args.jobs)
    walls = {r["method"]: r["wall_seconds"] for r in rows}
    speed, sort_s = seed.fit(walls, p.startup_s)
    print("speed 1: " + ", ".join(f"{m} {w:.1f} s" for m, w in walls.items()))
    print(f"fitted: speed = {speed:.4f}, sort overhead = {sort_s:.1f} s -> sort_s_per_1k = {sort_s / (len(wl) / 1000):.4f}")


def calibrate_and_predict(args, profile, opts) -> None:
    from sim.calibrate import compare, fit, read_run

    report: dict = {"profile_before": asdict(profile)}
    if args.calibrate:
        wl, summary, times = read_run(args.calibrate, args.model)
        profile, detail = fit(profile, wl, summary, times, args.run_policy, opts)
        print(f"calibrated on {args.calibrate}: speed {detail['speed']}, start {detail['start_s']} s")
        fitted_back = compare(profile, wl, summary, times, args.run_policy, opts)
        print(f"  the calibration run itself: measured {fitted_back['measured_wall_seconds']:.1f} s / {fitted_back['measured_hit_rate']:.1%},"
              f" simulated {fitted_back['predicted_wall_seconds']:.1f} s / {fitted_back['predicted_hit_rate']:.1%}")
        report["calibration"] = detail | {"run": fitted_back}
        if args.save_profile:
            profile.save(args.save_profile)
            print(f"wrote {args.save_profile}")
    report["profile"] = asdict(profile)
    report["predictions"] = []
    for spec in args.predict:
        out, _, kv = spec.partition(":")
        p = type(profile).from_dict(asdict(profile))
        if kv:
            p.kv_blocks = int(kv)
        wl, summary, times = read_run(out, args.model)
        c = compare(p, wl, summary, times, args.run_policy, opts) | {"kv_blocks": p.kv_blocks}
        report["predictions"].append(c)
        ok_w = abs(c["wall_error"]) <= 0.15
        ok_h = abs(c["hit_error_points"]) <= 3
        print(f"predicted {out}: wall {c['predicted_wall_seconds']:.1f} s vs measured {c['measured_wall_seconds']:.1f} s "
              f"({c['wall_error']:+.1%}, {'ok' if ok_w else 'MISSED'} ±15%); hit {c['predicted_hit_rate']:.1%} vs "
              f"{c['measured_hit_rate']:.1%} ({c['hit_error_points']:+.1f} points, {'ok' if ok_h else 'MISSED'} ±3)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
