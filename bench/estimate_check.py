"""Validate the memory estimator against what llama.cpp really allocates (CPU, this machine).

For each model and configuration it loads the model with llama.cpp, reads the buffer sizes
llama.cpp logs, and compares them with ``scheduler.gguf.estimate`` per component. Models: tiny
generated llama (grouped-query attention, two sizes), qwen2 and gemma3 (sliding window),
plus the demo model (gemma3 270M) when installed. Grid: num_ctx {512, 2048, 8192} ×
num_parallel {1, 4} × flash attention {off, on} × KV type {f16, q8_0}.

    python bench/estimate_check.py            # the table and the verdict
    python bench/estimate_check.py --fit      # also fit compute constants (calibration.py)

Targets: KV within 0.1 MiB, weights within 1 %, total within 5 % and never more than 2 %
below llama.cpp. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler.gguf.calibration import CALIBRATED, ComputeConstants  # noqa: E402
from scheduler.gguf.estimate import compute_model_bytes, estimate  # noqa: E402
from scheduler.gguf.metadata import ModelInfo, read_model_info  # noqa: E402
from scheduler.gguf.registry import demo_installed, demo_model_path  # noqa: E402
from scheduler.protocol import RunnerConfig  # noqa: E402
from scheduler.units import MIB  # noqa: E402
from tests.tinymodel import calibration_models  # noqa: E402
from workers.measure import Measured, measure_config  # noqa: E402

# llama.cpp refuses a quantized V cache without flash attention, so q8_0 runs with it only.
GRID = [
    (ctx, par, fa, kv)
    for ctx, par, fa, kv in itertools.product(
        [512, 2048, 8192], [1, 4], [False, True], ["f16", "q8_0"]
    )
    if fa or kv == "f16"
]


@dataclass
class Row:
    model: str
    info: ModelInfo
    cfg: RunnerConfig
    measured: Measured


def measure_all(
    models: dict[str, Path], grid: list[tuple[int, int, bool, str]], per_sequence: bool = False
) -> list[Row]:
    rows = []
    for name, path in models.items():
        info = read_model_info(path)
        for num_ctx, par, fa, kv in grid:
            cfg = RunnerConfig(
                num_ctx=num_ctx,
                num_parallel=par,
                kv_type=kv,
                flash_attn=fa,
                n_outputs=par if per_sequence else 0,
            )
            m = measure_config(str(path), cfg)
            rows.append(Row(name, info, cfg, m))
    return rows


def fit(rows: list[Row]) -> dict[tuple[str, bool], ComputeConstants]:
    """Least squares for the per-token constant, then the fixed part raised until no
    measurement is under-estimated (an under-estimate crashes a GPU; a few KiB over does not)."""
    import numpy as np

    fitted = {}
    for key in sorted({(r.info.architecture, r.cfg.flash_attn) for r in rows}):
        group = [r for r in rows if (r.info.architecture, r.cfg.flash_attn) == key]
        xs = [float(compute_model_bytes(r.info, r.cfg)) for r in group]
        ys = [float(r.measured.compute) for r in group]
        a = np.vstack([xs, np.ones(len(xs))]).T
        scale, _c = np.linalg.lstsq(a, np.array(ys), rcond=None)[0]
        scale = round(max(0.5, float(scale)), 4)
        fixed = max(0, max(int(np.ceil(y - scale * x)) for x, y in zip(xs, ys, strict=True)))
        fitted[key] = ComputeConstants(scale=scale, fixed=fixed)
    return fitted


def compare(rows: list[Row]) -> tuple[list[dict[str, float | str]], dict[str, float]]:
    table = []
    for r in rows:
        est = estimate(r.info, r.cfg).by_device()["host"]
        m = r.measured
        measured_total = m.weights + m.kv + m.compute + m.output
        table.append(
            {
                "model": r.model,
                "num_ctx": r.cfg.num_ctx,
                "parallel": r.cfg.num_parallel,
                "flash_attn": int(r.cfg.flash_attn),
                "kv_type": r.cfg.kv_type,
                "weights_mib": m.weights / MIB,
                "weights_err_pct": 100 * (est.weights / m.weights - 1),
                "kv_mib": m.kv / MIB,
                "kv_diff_mib": (est.kv - m.kv) / MIB,
                "compute_mib": m.compute / MIB,
                "compute_est_mib": est.compute / MIB,
                "output_mib": m.output / MIB,
                "output_diff_mib": (est.output - m.output) / MIB,
                "total_mib": measured_total / MIB,
                "total_est_mib": est.total / MIB,
                "total_err_pct": 100 * (est.total / measured_total - 1),
            }
        )
    summary = {
        "cases": len(table),
        "kv_max_abs_diff_mib": max(abs(float(t["kv_diff_mib"])) for t in table),
        "weights_max_abs_err_pct": max(abs(float(t["weights_err_pct"])) for t in table),
        "total_max_err_pct": max(float(t["total_err_pct"]) for t in table),
        "total_min_err_pct": min(float(t["total_err_pct"]) for t in table),
        "output_max_abs_diff_mib": max(abs(float(t["output_diff_mib"])) for t in table),
    }
    return table, summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--fit", action="store_true", help="fit and print compute constants")
    parser.add_argument("--no-demo", action="store_true", help="tiny models only")
    parser.add_argument(
        "--outputs-per-sequence",
        action="store_true",
        help="contexts with one output row per sequence (n_outputs = num_parallel), as the "
        "runners' decode loop uses",
    )
    args = parser.parse_args()
    models = calibration_models(Path(tempfile.mkdtemp(prefix="ggufq-est-")))
    if demo_installed() and not args.no_demo:
        models["gemma3-270m"] = demo_model_path()
    rows = measure_all(models, GRID, args.outputs_per_sequence)
    if args.fit:
        fitted = fit(rows)
        print("CALIBRATED = {")
        for (arch, fa), c in fitted.items():
            print(f"    ({arch!r}, {fa}): ComputeConstants(scale={c.scale}, fixed={c.fixed}),")
        print("}")
        CALIBRATED.clear()
        CALIBRATED.update(fitted)
    table, summary = compare(rows)
    cols = [
        "model",
        "num_ctx",
        "parallel",
        "flash_attn",
        "kv_type",
        "weights_err_pct",
        "kv_mib",
        "kv_diff_mib",
        "compute_mib",
        "compute_est_mib",
        "total_mib",
        "total_est_mib",
        "total_err_pct",
    ]
    print(" | ".join(cols))
    for t in table:
        print(" | ".join(f"{t[c]:.3f}" if isinstance(t[c], float) else str(t[c]) for c in cols))
    ok = (
        summary["kv_max_abs_diff_mib"] <= 0.1
        and summary["weights_max_abs_err_pct"] <= 1
        and summary["total_max_err_pct"] <= 5
        and summary["total_min_err_pct"] >= -2
    )
    print(f"targets (KV ±0.1 MiB, weights ±1 %, total -2 %..+5 %): {'met' if ok else 'NOT met'}")
    print(json.dumps({"bench": "estimate_check", **summary, "targets_met": ok}))


if __name__ == "__main__":
    main()
