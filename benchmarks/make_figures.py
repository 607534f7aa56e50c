"""Draw the walkthrough's figures from the committed benchmark results (nothing is re-measured).

    python benchmarks/make_figures.py                       # from benchmarks/results/cpu-small.json
    python benchmarks/make_figures.py --results benchmarks/results/nvidia-h100-80gb-hbm3-gpt2.json

Writes into docs/img/: tokens_per_s.png, stage_times.png and memory_breakdown.png, each titled
with the machine, versions and date of the measurement. The colours are the stage registry's
(minigpt.config.STAGES) and the PNGs carry no version or date: the same results give the same bytes.
The TensorBoard screenshots come from docs/tensorboard_screenshots.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder is on sys.path: the sibling modules import directly.
from ablation import PNG_METADATA, plot_memory, plot_stages, plot_tokens
from common import NOT_RESULTS, Parser, check_out_dir, load_results, machine_line

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "cpu-small.json")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = p.parse_args()
    if not args.results.exists():
        p.error(f"{args.results} does not exist; run python benchmarks/ablation.py first")
    data = load_results(p, args.results)
    check_out_dir(p, args.out, "--out")
    try:
        draw(data, args.out)
    except NOT_RESULTS as e:
        p.error(f"{args.results} is not an ablation results file ({type(e).__name__}: {e})")
    except OSError as e:
        p.error(f"cannot write the figures in {args.out} ({e.strerror or e})")
    return 0


def draw(data: dict, out: Path) -> None:
    """The three figures, each on its own canvas, into `out`."""
    meta, results = data["meta"], data["results"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {}  # every figure drawn before any is written: a bad results file leaves `out` as it was
    for name, plot in (
        ("tokens_per_s", plot_tokens),
        ("stage_times", plot_stages),
        ("memory_breakdown", plot_memory),
    ):
        fig, ax = plt.subplots(figsize=(8.5, 4.5), layout="constrained")
        figures[name] = fig
        plot(ax, results)
        ax.tick_params(axis="x", labelrotation=15, labelsize=8)
        fig.suptitle(f"{meta['name']}: {machine_line(meta)}\n{meta['command']}", fontsize=8)
    out.mkdir(parents=True, exist_ok=True)
    for name, fig in figures.items():
        fig.savefig(out / f"{name}.png", dpi=110, metadata=PNG_METADATA)
        plt.close(fig)
        print(f"wrote {out / name}.png")


if __name__ == "__main__":
    sys.exit(main())
