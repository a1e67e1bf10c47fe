"""`slipstream plot RUN_DIR`: loss, learning rate, gradient norm, loss scale, samples/s and memory of a run,
drawn from its csv monitor files (`csv_monitor.output_path`/`job_name`) into one PNG."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

HELP = "draw a run's csv monitor figures (loss, lr, grad norm, loss scale, samples/s, memory) as a PNG"

PANELS = (
    ("Train_Samples_train_loss.csv", "loss", 1.0),
    ("Train_Samples_lr.csv", "learning rate", 1.0),
    ("Train_Samples_grad_norm.csv", "gradient norm (before clipping)", 1.0),
    ("Train_Samples_loss_scale.csv", "loss scale (fp16)", 1.0),
    ("Train_Samples_samples_per_sec.csv", "samples/s", 1.0),
    ("Train_Samples_memory_bytes.csv", "memory (GiB; RSS on the CPU)", 1.0 / 2**30),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the csv monitor's directory: <csv_monitor.output_path>/<job_name>")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: RUN_DIR/run.png)")


def read_series(path: Path) -> tuple[list[float], list[float]]:
    samples, values = [], []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            samples.append(float(row["step"]))
            values.append(float(row["value"]))
    return samples, values


def draw(run_dir: Path, output: Path) -> list[str]:
    """Write the PNG; return the titles of the panels drawn. Raises FileNotFoundError when no series exists."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        (title, *read_series(run_dir / name), scale) for name, title, scale in PANELS if (run_dir / name).is_file()
    ]
    if not series:
        expected = ", ".join(name for name, _, _ in PANELS)
        raise FileNotFoundError(f"{run_dir} holds none of the csv monitor's files ({expected})")
    columns = 3 if len(series) > 4 else 2
    rows = -(-len(series) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for axis, (title, samples, values, scale) in zip(axes.flat, series, strict=False):
        axis.plot(samples, [v * scale for v in values], marker="." if len(values) < 50 else None)
        axis.set_title(title)
        axis.set_xlabel("samples")
        axis.ticklabel_format(axis="y", useOffset=False)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(series) :]:
        axis.set_visible(False)
    figure.suptitle(f"run {run_dir.name}")
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return [title for title, *_ in series]


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    output = Path(args.output) if args.output else run_dir / "run.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("slipstream plot needs matplotlib: pip install 'slipstream[plot]'")
        return 1
    try:
        drawn = draw(run_dir, output)
    except FileNotFoundError as exc:
        print(f"slipstream plot: {exc}; point it at <csv_monitor.output_path>/<job_name>")
        return 1
    print(f"wrote {output} ({', '.join(drawn)})")
    return 0
