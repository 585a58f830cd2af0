"""Every shipped config runs on the hardware its header names (vit_h14_jft once said 256 x H100
but its micro batch 32 x 256 ranks overshot the global batch 4096).

Each header carries a ``# Check:`` line, the exact ``vit-launch check`` command for its documented
world size and GPU memory; this test runs exactly that. The dataset path is replaced by a small
fake manifest (the real data lives on the cluster): its tars hold headers only, as many samples as
the documented layout needs, so the shard checks pass and what is tested is the config's batch
arithmetic and memory estimate. The disk is the cluster's too: the free-space figure is stood in.
"""
import contextlib
import io
import json
import re
import shlex
import tarfile
import types
from pathlib import Path

import pytest

from launch import preflight
from launch.cli import main, parser
from launch.commands.options import launch_spec
from launch.runner import spec_world_size
from pretrain.config import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs").glob("*.yaml"))


def header(config: str) -> dict[str, str]:
    """``# Key:  text`` lines of the leading comment block, continuation lines joined."""
    fields, key = {}, None
    for line in (REPO / config).read_text().splitlines():
        if not line.startswith("#"):
            break
        m = re.match(r"#\s?([A-Z][a-z]+):\s+(.*)", line)
        if m:
            key = m.group(1)
            fields[key] = m.group(2).strip()
        elif key and line[1:].strip():
            fields[key] += " " + line[1:].strip()
    return fields


def documented_world(config: str) -> int:
    """The world size of the header's ``# Check:`` command."""
    argv = shlex.split(header(config)["Check"])
    return int(argv[argv.index("--world-size") + 1])


def fake_shards(root: Path, classes: int, samples: int, multi_label: bool, n_shards: int = 8) -> Path:
    """``n_shards`` tars of empty ``<key>.cls`` members (512-byte headers, no image) and their manifest."""
    from data_pipeline.shards.manifest import FORMAT, VERSION, write_manifest

    root.mkdir(parents=True)
    entries, key = [], 0
    for i in range(n_shards):
        n = samples // n_shards + (i < samples % n_shards)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for _ in range(n):
                tar.addfile(tarfile.TarInfo(f"{key:08d}.cls"), io.BytesIO(b""))
                key += 1
        (root / f"train-{i:06d}.tar").write_bytes(buf.getvalue())
        entries.append({"name": f"train-{i:06d}.tar", "samples": n, "bytes": len(buf.getvalue())})
    write_manifest(root, {"format": FORMAT, "version": VERSION, "split": "train", "source": "test",
                          "classes": [f"c{i}" for i in range(classes)], "multi_label": multi_label,
                          "total": samples, "shards": entries})
    return root / "manifest.json"


@pytest.mark.parametrize("config", CONFIGS)
def test_config_passes_its_documented_check(config, tmp_path, capsys, monkeypatch):
    h = header(config)
    assert "Check" in h and "Run" in h and "Hardware" in h, f"{config}: header lacks Check / Run / Hardware lines"
    argv = shlex.split(h["Check"])
    assert argv[:2] == ["vit-launch", "check"] and argv[argv.index("--config") + 1] == config, h["Check"]
    world = int(argv[argv.index("--world-size") + 1])
    # the check is for the hardware the header names: "Hardware: 256 x H100 80GB (32 nodes x 8)"
    hw = (re.match(r"(\d+) x (?:\S+ )?(?:(\d+)GB)?", h["Hardware"])
          or re.match(r"\d+ CPU cores \((\d+) ranks\)", h["Hardware"]))
    assert hw and int(hw.group(1)) == world, (h["Hardware"], world)
    if hw.lastindex == 2 and hw.group(2):
        assert float(argv[argv.index("--gpu-memory-gb") + 1]) == float(hw.group(2)), h["Check"]
    nodes = re.search(r"\((\d+) nodes x (\d+)\)", h["Hardware"])
    if nodes:
        assert int(nodes.group(1)) * int(nodes.group(2)) == world

    # the Run command starts that many ranks (its hosts.txt: one "host slots=G" line per node)
    run = shlex.split(h["Run"].split("(")[0])
    assert run[:1] == ["vit-launch"] and run[run.index("--config") + 1] == config
    if "--hostfile" in run:
        hosts = tmp_path / "hosts.txt"
        hosts.write_text("".join(f"node{i:03d} slots=8\n" for i in range(int(run[run.index("--num-nodes") + 1]))))
        run[run.index("--hostfile") + 1] = str(hosts)
    assert spec_world_size(launch_spec(parser("run").parse_intermixed_args(run[1:])))[0] == world, h["Run"]

    cfg = load_config(config)
    slots = world * max(1, cfg.data.workers)
    manifest = fake_shards(tmp_path / "shards", cfg.model.num_classes, slots * cfg.train.micro_batch_size,
                           cfg.data.multi_label)
    disk = types.SimpleNamespace(total=10 ** 15, used=0, free=10 ** 15)  # the cluster's disk, not this one
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: disk)
    with pytest.raises(SystemExit) as e:
        main([*argv[1:], f"data.train_shards={manifest}", f"train.output_dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and err == "", err  # no error and no warning (memory fits the documented GPU)
    gas = cfg.train.global_batch_size // (cfg.train.micro_batch_size * world)
    assert (f"ok  batch: global {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x {world} rank(s) "
            f"x {gas} accumulation step(s)") in out
    assert "ok  memory:" in out
    if "Batch" in h:  # the header's arithmetic is the config's
        assert h["Batch"].startswith(
            f"{cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x {world} ranks")


def test_paper_recipes_keep_the_paper_batch():
    """The ViT paper's recipes (their first header line cites it) train at its batch of 4096; the
    later recipes keep their own sources' batches (tests/unit/test_recipe_configs.py)."""
    paper = [c for c in CONFIGS if "(ViT paper" in (REPO / c).read_text().splitlines()[0]]
    assert len(paper) == 3, paper
    for config in paper:
        assert load_config(config).train.global_batch_size == 4096, config


def test_the_readme_slurm_example_writes_its_script(tmp_path, capsys):
    """README "SLURM": vit_h14_jft on 32 nodes x 8 GPUs (it used to be written and then fail in the job)."""
    out = tmp_path / "vit_h14.sbatch"
    with pytest.raises(SystemExit) as e:
        main(["slurm", "--config", "configs/vit_h14_jft.yaml", "--nodes", "32", "--gpus-per-node", "8",
              "--partition", "gpu", "--time", "2-00:00:00", "--log-dir", str(tmp_path / "logs"), "--output", str(out)])
    assert e.value.code == 0, capsys.readouterr().err
    assert "#SBATCH --nodes=32" in out.read_text()


# each GPU config with the GPUs its header names ("8 x H100 80GB", "64 x A100/H100 80GB")
ON_GPUS = [(c, gpu) for c in CONFIGS if "80GB" in header(c)["Hardware"]
           for gpu, name in (("h100-sxm", "H100"), ("a100-80gb", "A100")) if name in header(c)["Hardware"]]


@pytest.mark.parametrize("config, gpu", ON_GPUS)
def test_config_s_layout_is_the_plan_s_best_on_its_hardware(config, gpu):
    """On the GPUs its header names, each shipped config's layout (its ZeRO stage, micro batch and
    checkpointing, ``auto`` decided as training decides it) is within 5 % of the best layout the
    plan finds for the same model, batch and compile setting (``vit-launch plan --search``), and the
    header says the stage it runs: a shipped recipe does not spend GPU-hours the plan says it need not
    (vit_h14_jft once ran ZeRO-3 at 0.30x the plan's best, where ZeRO-2 fits)."""
    from pretrain.perf import levers
    from pretrain.perf.advice import search
    from pretrain.perf.perfmodel import layout_from_config, predict

    h = header(config)
    world = documented_world(config)
    per_node = min(8, world)
    cfg, _ = levers.resolve(load_config(config), world, gpus_per_node=per_node, gpu=gpu, memory_bytes=80 * 2 ** 30)
    layout = layout_from_config(cfg, nodes=world // per_node, gpus_per_node=per_node, gpu=gpu)
    ours, best = predict(layout), search(layout)[0]
    assert ours.fits and ours.images_per_second >= 0.95 * best.images_per_second, (config, best.layout)
    assert f"ZeRO-{cfg.zero.stage}" in h["Hardware"], (config, h["Hardware"])


# ------------------------------------------------------------------- the plan's figures in headers
def _plan(config: str, world: int, gpu: str, *overrides: str) -> dict:
    """``vit-launch plan --config C --world-size W --gpu G --json`` as a user runs it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main(["plan", "--config", config, "--world-size", str(world), "--gpu", gpu, "--json", *overrides])
    assert e.value.code == 0, (config, overrides)
    return json.loads(out.getvalue())


def _gpus(plan: dict) -> int:
    return plan["layout"]["nodes"] * plan["layout"]["gpus_per_node"]


def _gpus_could_take(p: dict) -> float:
    """The img/s per node an input-bound layout's GPUs could take (its bottleneck line): the step's
    images on one node over the step without waiting for batches."""
    lay = p["layout"]
    return lay["global_batch"] / lay["nodes"] / (p["compute_seconds"] + p["optimizer_seconds"]
                                                 + p["exposed_comm_seconds"])


def _same(claim: str, value: float) -> bool:
    """The claim is the value as the plan prints it: rounded to the claim's own digits."""
    digits = len(claim.split(".")[1]) if "." in claim else 0
    return f"{value:,.{digits}f}" == claim


HEADER_FIGURES = [  # what a header may quote of the plan, each tied to the plan's JSON
    (r"predicts ([\d,]+) img/s", lambda p, m: p["images_per_second"]),
    (r"\(([\d.]+) ms a step", lambda p, m: p["step_seconds"] * 1e3),
    (r"about (\d+) h for the", lambda p, m: p["run"]["hours"]),
    (r"about (\d+) min for the", lambda p, m: p["run"]["hours"] * 60),
    (r"about ([\d.]+) GB per GPU", lambda p, m: max([p["memory_gb_per_gpu"]["total"]] + [
        r["memory_gb_per_gpu"] for r in p.get("tokens", {}).get("phases", [])])),
    (r"([\d.]+) h against [\d.]+ h", lambda p, m: p["tokens"]["seconds"] / 3600),
    (r"[\d.]+ h against ([\d.]+) h", lambda p, m: p["tokens"]["fixed_seconds"] / 3600),
    (r"([\d,]+) against [\d,]+ GPU-hours", lambda p, m: p["tokens"]["seconds"] * _gpus(p) / 3600),
    (r"[\d,]+ against ([\d,]+) GPU-hours", lambda p, m: p["tokens"]["fixed_seconds"] * _gpus(p) / 3600),
    (r"([\d.]+)x the time", lambda p, m: p["tokens"]["seconds"] / p["tokens"]["fixed_seconds"]),
    (r"([\d.]+)x the (?:training )?FLOPs", lambda p, m: p["tokens"]["flops"] / p["tokens"]["fixed_flops"]),
    (r"([\d.]+) % MFU at (\d+) px", lambda p, m: 100 * next(
        r["mfu"] for r in p["tokens"]["phases"] if r["img_size"] == int(m.group(2)))),
    (r"the GPUs could take ([\d,]+)", lambda p, m: _gpus_could_take(p)),
    (r"([\d,]+) the GPUs could take", lambda p, m: _gpus_could_take(p)),
]
# "puts ZeRO-2 at 61,818 img/s (24.5 % MFU, 4,880 GPU-hours for the run) and ZeRO-3 at ...": the
# config at each stage it names
STAGE_FIGURES = re.compile(r"ZeRO-(\d) at ([\d,]+) img/s \(([\d.]+) % MFU, ([\d,]+) GPU-hours")


@pytest.mark.parametrize("config", sorted({c for c, _ in ON_GPUS}))
def test_header_figures_are_the_plan_s(config):
    """What a header quotes of ``vit-launch plan`` (img/s, step time, run time, memory, a schedule's
    saving, MFU per phase, one stage against another) is what the plan prints today for the
    header's world size and GPU (the last ``--gpu`` named before the figure; H100 otherwise): the
    model behind them moves (vit_l16_in21k once said 5 GB per GPU, from when it checkpointed every
    block, where the plan said 13). Every GPU header quotes some, and its memory."""
    text, world = " ".join(header(config).values()), documented_world(config)  # the header's fields, in order
    plans: dict = {}

    def plan_at(pos: int, *overrides: str) -> dict:
        gpus = [m for m in re.finditer(r"--gpu ([\w-]+)", text) if m.start() < pos]
        key = (gpus[-1].group(1) if gpus else "h100-sxm", *overrides)
        if key not in plans:
            plans[key] = _plan(config, world, *key)
        return plans[key]

    checked, wrong = [], []
    for pattern, figure in HEADER_FIGURES:
        for m in re.finditer(pattern, text):
            value = figure(plan_at(m.start()), m)
            checked.append(m.group(0))
            if not _same(m.group(1), value):
                wrong.append(f"{m.group(0)!r}: the plan says {value:,.4g}")
    for m in STAGE_FIGURES.finditer(text):
        p = plan_at(m.start(), f"zero.stage={m.group(1)}")
        checked.append(m.group(0))
        for claim, value in zip(m.groups()[1:], (p["images_per_second"], 100 * p["mfu"], p["run"]["gpu_hours"])):
            if not _same(claim, value):
                wrong.append(f"{m.group(0)!r}: {claim} where the plan says {value:,.4g}")
    assert not wrong, (config, wrong)
    assert any("GB per GPU" in c for c in checked), (config, "no memory figure", checked)
    assert len(checked) >= 2, (config, checked)
