"""`prefixflow bench batching`'s pure parts: setting names and the ratio table."""

from __future__ import annotations

import pytest

from prefixflow.bench.batching import setting_args, summarize

pytestmark = pytest.mark.unit


def test_setting_names():
    assert setting_args("adaptive") == []
    assert setting_args("adaptive-30") == ["--first-result-seconds", "30"]
    assert setting_args("static-64") == ["--no-adaptive", "--window", "64"]
    for bad in ("static", "static-0", "static-x", "adaptive-0", "fixed-64"):
        with pytest.raises(ValueError):
            setting_args(bad)


def run(shape, setting, progress, result, tps):
    return dict(shape=shape, setting=setting, first_progress_seconds=progress, first_result_seconds=result,
                wall_seconds=100.0, output_tokens_per_second=tps, hit_rate=0.5)


def test_ratios_are_against_the_best_static_setting_of_each_shape_on_medians():
    runs = [
        run("a", "adaptive", 1.0, 10.0, 990.0), run("a", "adaptive", 3.0, 12.0, 1010.0), run("a", "adaptive", 2.0, 11.0, 1000.0),
        run("a", "static-64", 1.0, 100.0, 1000.0), run("a", "static-256", 1.0, 110.0, 900.0),
        run("b", "adaptive", 1.0, 5.0, 500.0), run("b", "static-64", 2.0, 50.0, 400.0),
    ]
    rows = {(r["shape"], r["setting"]): r for r in summarize(runs)}
    a = rows["a", "adaptive"]
    assert a["rounds"] == 3 and a["first_progress_seconds"] == 2.0 and a["first_result_seconds"] == 11.0
    assert a["vs_best_static"] == "static-64"
    assert a["throughput_ratio"] == 1.0 and a["first_result_ratio"] == 0.11
    assert rows["a", "static-256"]["throughput_ratio"] == 0.9
    b = rows["b", "adaptive"]
    assert b["vs_best_static"] == "static-64" and b["throughput_ratio"] == 1.25 and b["first_progress_ratio"] == 0.5
