"""Images/s and scaling efficiency against world size, from the runs' own metrics files.

    python -m launch.plot_scaling RUN_DIR [RUN_DIR ...] [--output scaling.png]

Each RUN_DIR is a ``train.output_dir``: ``metrics.jsonl`` (one record per logged window) and
``summary.json`` (its ``world_size``; without it, world size = images_per_sec /
images_per_sec_per_device of the records). The windows that hold a first step (``cold_steps``: the
first window of each invocation, a resume's too, and of each resolution phase: data-loader start,
a resumed loader's replay, a trace, first NCCL/gloo connections) are dropped as warm-up, or, in
metrics without that mark, the first window; images/s is the remaining windows' images over their
seconds (not the mean of their rates, which a slow window
would sway less than it cost), and MFU and the data-wait share are weighted by those seconds
alike. Several runs at one world size are pooled the same way: their images over their seconds,
MFU and data wait weighted by each run's seconds (a short run sways the row as little as it
measured).

Scaling efficiency = (images/s per rank at N) / (images/s per rank at the smallest N measured):
1.0 is linear scaling. It reads the same for weak scaling (fixed micro batch per rank) and strong
scaling (fixed global batch), since both are measured in images/s.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from data_pipeline.errors import ConfigError, Parser, cli_errors, path_arg
from data_pipeline.files import check_output_file


class PlotError(ConfigError):
    """A run folder that cannot be read, or a plot file that cannot be written; one line naming it."""


def check_plot_output(path: str | Path, flag: str = "--output") -> None:
    """ConfigError (one line naming ``flag`` and ``path``) when the plot could not be written there:
    a folder there, no file can be created in its folder, or an extension matplotlib does not write
    (it would fail only after every run was read). Call it before any run is read or started;
    ``flag``: the option that names the file (``--plot`` for ``vit-launch sweep``). Imports
    matplotlib (a fraction of a second), not pyplot."""
    from matplotlib.backend_bases import FigureCanvasBase

    check_output_file(path, flag=flag)
    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = Path(path).suffix.lower().removeprefix(".")
    if ext not in kinds:
        got = f"extension .{ext}" if ext else "no extension"
        raise PlotError(f"{flag} {path}: {got}; a plot file ends in one of .{', .'.join(sorted(kinds))}")


@dataclass(frozen=True)
class RunStats:
    run_dir: str
    world_size: int
    windows: int  # logged windows used (after warm-up)
    mfu: Optional[float]
    data_wait_share: Optional[float]
    images: float  # in the windows used
    seconds: float  # those windows' time

    @property
    def images_per_sec(self) -> float:
        return self.images / self.seconds


def _over_time(values, seconds) -> Optional[float]:
    """The mean of per-window ``values`` weighted by each window's ``seconds`` (None where a window
    lacks its value: a share of the time is only known for all of it)."""
    if not all(isinstance(v, (int, float)) for v in values):
        return None
    return sum(v * s for v, s in zip(values, seconds)) / sum(seconds)


def load_run(run_dir: str | Path) -> RunStats:
    d = Path(run_dir)
    path = d / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{d}: no metrics.jsonl (is it a train.output_dir with logging.jsonl=true?)")
    by_step: dict[int, dict] = {}
    lines = path.read_text().splitlines()
    for no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if no == len(lines):
                continue  # a run killed mid-write leaves a partial last line
            raise PlotError(f"{path}:{no}: not a JSON record") from None
        if "step" in rec and "images_per_sec" in rec:
            by_step[rec["step"]] = rec  # a step re-logged after a resume keeps its last value
    recs = [by_step[s] for s in sorted(by_step)]
    # (previous record, window): the windows after a warm-up one; with no cold_steps mark, the first
    pairs = [(p, r) for p, r in zip(recs, recs[1:]) if not r.get("cold_steps", 0)]
    if not pairs:
        raise PlotError(f"{path}: {len(recs)} logged window(s), none after warm-up (a start's, a resume's or a "
                        "resolution phase's first); run more steps or lower train.log_every_steps")
    used = [r for _, r in pairs]
    # each window's images (examples_seen, every rank's; else its steps: a fixed global batch) and seconds
    images = [(r.get("examples_seen", r["step"]) - p.get("examples_seen", p["step"])) for p, r in pairs]
    for n, r in zip(images, used):
        if n <= 0 or not r["images_per_sec"] > 0:
            raise PlotError(f"{path}: the window ending at step {r['step']} holds {n} images at "
                            f"{r['images_per_sec']} images/s; not a training window")
    seconds = [n / r["images_per_sec"] for n, r in zip(images, used)]
    world = None
    summary = d / "summary.json"
    if summary.is_file():
        world = json.loads(summary.read_text()).get("world_size")
    if not world:
        r = used[-1]
        world = (round(r["images_per_sec"] / r["images_per_sec_per_device"])
                 if r.get("images_per_sec_per_device") else None)
    if not world:
        raise PlotError(f"{d}: world size unknown (no summary.json and no images_per_sec_per_device)")
    return RunStats(str(d), int(world), len(used),
                    _over_time([r.get("mfu") for r in used], seconds),
                    _over_time([r.get("data_wait_share") for r in used], seconds), sum(images), sum(seconds))


def scaling_table(runs: list[RunStats]) -> list[dict]:
    """One row per world size, ascending, with efficiency against the smallest size."""
    sizes = sorted({r.world_size for r in runs})
    rows = []
    for n in sizes:
        group = [r for r in runs if r.world_size == n]
        rows.append({"world_size": n, "runs": len(group),
                     "images_per_sec": sum(r.images for r in group) / sum(r.seconds for r in group),
                     "mfu": _over_time([r.mfu for r in group], [r.seconds for r in group]),
                     "data_wait_share": _over_time([r.data_wait_share for r in group], [r.seconds for r in group]),
                     "run_dirs": [r.run_dir for r in group]})
    ref = rows[0]
    for row in rows:
        row["images_per_sec_per_rank"] = row["images_per_sec"] / row["world_size"]
        row["efficiency"] = row["images_per_sec_per_rank"] / (ref["images_per_sec"] / ref["world_size"])
    return rows


def format_table(rows: list[dict]) -> str:
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    head = (f"{'world':>5}  {'runs':>4}  {'images/s':>10}  {'per rank':>9}  "
            f"{'efficiency':>10}  {'data wait':>9}  {'MFU':>6}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['world_size']:>5}  {r['runs']:>4}  {r['images_per_sec']:>10.1f}  "
                     f"{r['images_per_sec_per_rank']:>9.1f}  {pct(r['efficiency']):>10}  "
                     f"{pct(r['data_wait_share']):>9}  {pct(r['mfu']):>6}")
    return "\n".join(lines)


def plot(rows: list[dict], output: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    n = [r["world_size"] for r in rows]
    ips = [r["images_per_sec"] for r in rows]
    ideal = [rows[0]["images_per_sec_per_rank"] * k for k in n]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(n, ideal, "--", color="grey", label="linear")
    a.plot(n, ips, "o-", label="measured")
    a.set(xlabel="world size (ranks)", ylabel="images / s (all ranks)", title="throughput")
    b.plot(n, [100 * r["efficiency"] for r in rows], "o-")
    b.axhline(100, ls="--", color="grey")
    b.set(xlabel="world size (ranks)", ylabel="% of linear", title="scaling efficiency",
          ylim=(0, max(110, 5 + max(100 * r["efficiency"] for r in rows))))
    for ax in (a, b):
        if len(n) > 1 and n[-1] / n[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(k) for k in n])
        ax.grid(alpha=0.3)
    a.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    ap = Parser(prog="plot_scaling", description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=path_arg, help="train.output_dir of each run")
    ap.add_argument("--output", default="scaling.png", type=path_arg, help="PNG to write (default: scaling.png)")
    ap.add_argument("--title", default="", help="figure title")
    args = ap.parse_args(argv)
    with cli_errors("plot_scaling", PlotError):
        check_plot_output(args.output)  # before reading the runs: a mistake costs a second
        rows = scaling_table([load_run(d) for d in args.run_dirs])
    print(format_table(rows))
    with cli_errors("plot_scaling", OSError):
        print(f"plot: {plot(rows, args.output, args.title)}")


if __name__ == "__main__":
    main()
