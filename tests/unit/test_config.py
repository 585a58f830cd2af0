"""Config loading: inheritance, overrides, validation errors through the CLI (exit 2, one line)."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pretrain.config import (
    ConfigError,
    check_world_size,
    from_dict,
    load_config,
    save_config,
    to_dict,
)
from pretrain.config.load import parse_override

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "pretrain.config", *args], capture_output=True, text=True,
                          cwd=REPO)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_load_and_have_a_header(path):
    cfg = load_config(path)
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0
    header = path.read_text().splitlines()[0]
    assert header.startswith("# "), f"{path.name} must open with a comment saying what it trains"
    assert "Expect" in path.read_text()


def test_paper_recipes_follow_table3():
    for name in ("vit_b16_in1k", "vit_l16_in21k", "vit_h14_jft"):
        c = load_config(REPO / "configs" / f"{name}.yaml")
        assert c.train.global_batch_size == 4096
        assert c.optim.betas == [0.9, 0.999]
        assert c.optim.warmup_steps == 10_000
        assert c.model.img_size in (None, 224)


def test_base_inheritance_deep_merges(tmp_path):
    write(tmp_path / "base.yaml",
          "model: {name: vit_small_patch16_224, num_classes: 7}\noptim: {lr: 0.5, warmup_steps: 3}\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\noptim: {lr: 0.25}\n")
    c = load_config(child)
    assert c.model.name == "vit_small_patch16_224" and c.model.num_classes == 7
    assert c.optim.lr == 0.25 and c.optim.warmup_steps == 3  # sibling key kept by the deep merge


def test_overrides_parse_yaml_scalars(tmp_path):
    c = load_config(REPO / "configs/tiny_cpu.yaml",
                    ["optim.lr=3e-4", "train.steps=7", "train.activation_checkpointing=true",
                     "logging.wandb.tags=[a, b]", "model.img_size=null", "data.train_shards=x-{0..3}.tar"])
    assert c.optim.lr == pytest.approx(3e-4) and isinstance(c.optim.lr, float)
    assert c.train.steps == 7 and c.train.activation_checkpointing is True
    assert c.logging.wandb.tags == ["a", "b"]
    assert c.model.img_size is None
    assert c.data.train_shards == "x-{0..3}.tar"
    assert parse_override("a.b=1") == (["a", "b"], 1)


def test_selective_checkpointing_is_a_word_that_stays_a_word():
    """``selective`` is kept through the levers' resolution (no block count to decide) and repeats
    no block's matmuls; a misspelling is one line naming the key and the words it takes."""
    from pretrain.config import checkpoint_count, selective_checkpointing
    from pretrain.perf import levers

    c = load_config(REPO / "configs/tiny_cpu.yaml", ["train.activation_checkpointing=selective"])
    resolved, choices = levers.resolve(c, 2, memory_bytes=80e9)
    assert resolved.train.activation_checkpointing == "selective" and choices.checkpoint_blocks == 0
    assert levers.resolve(resolved, 2)[0] == resolved  # idempotent
    assert selective_checkpointing("selective") and checkpoint_count("selective", 12) == 0
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/tiny_cpu.yaml", ["train.activation_checkpointing=selectve"])
    assert "train.activation_checkpointing" in str(e.value) and "'selective'" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_auto_bucket_line_counts_the_buckets_over_the_whole_model():
    """The start-up line of ``zero.reduce_bucket_size: auto`` says how many buckets the model's
    gradients make and how many parameters they hold in all, for a model of any size."""
    import re

    from pretrain.perf import levers

    def line(name, world):
        c = load_config(REPO / "configs/tiny_cpu.yaml", [f"model.name={name}", "zero.reduce_bucket_size=auto"])
        lines = levers.resolve(c, world, gpu="h100-sxm")[1].lines
        return next(x for x in lines if x.startswith("zero.reduce_bucket_size=auto: "))

    assert line("test_vit", 1).endswith(" elements (1 bucket over the model's 0.302M parameters)"), line("test_vit", 1)
    big = re.search(r" elements \((\d+) buckets over the model's 303M parameters\)$", line("vit_large_patch16_224", 64))
    assert big and int(big.group(1)) > 1, line("vit_large_patch16_224", 64)


def test_yaml_floats_as_users_write_them_in_files_and_overrides(tmp_path):
    """YAML 1.1 reads ``1e-3`` (no dot) and ``1E5``, ``1.5e3`` (no exponent sign) as strings; the
    config reads them as the floats the docs and every user write, in a file as on the command line."""
    f = write(tmp_path / "f.yaml", f"base: {REPO / 'configs/tiny_cpu.yaml'}\n"
              "optim: {lr: 1e-3, min_lr: 2e-4, eps: 1E-8, weight_decay: .5, betas: [9e-1, 1.5e-1]}\n"
              "train: {steps: 1E3}\n")
    c = load_config(f)
    assert (c.optim.lr, c.optim.min_lr, c.optim.eps, c.optim.weight_decay) == (1e-3, 2e-4, 1e-8, 0.5)
    assert c.optim.betas == [0.9, 0.15] and c.train.steps == 1000 and isinstance(c.train.steps, int)
    o = load_config(REPO / "configs/tiny_cpu.yaml", ["optim.lr=1e-3", "optim.eps=1E-8", "optim.min_lr=2e-4",
                                                      "optim.weight_decay=.5"])
    assert (o.optim.lr, o.optim.eps, o.optim.min_lr, o.optim.weight_decay) == (1e-3, 1e-8, 2e-4, 0.5)
    with pytest.raises(ConfigError, match=r"optim\.min_lr: .*got -0\.0002$"):  # a signed one is a number too
        load_config(REPO / "configs/tiny_cpu.yaml", ["optim.min_lr=-2e-4"])
    r = run_cli("--config", str(f))
    assert r.returncode == 0 and "lr: 0.001" in r.stdout, r.stderr
    assert parse_override("data.train_shards=x1e3") == (["data", "train_shards"], "x1e3")  # not a number


def test_a_typo_in_an_override_names_the_command_line_not_the_file(tmp_path):
    r = run_cli("--config", "configs/tiny_cpu.yaml", "trian.steps=3")
    assert r.returncode == 2 and r.stderr == ("vit-config: error: command line: unknown key 'trian'; did you mean "
                                              "'train'?\n"), r.stderr
    with pytest.raises(ConfigError, match=r"^command line: unknown key 'train\.stepz'"):
        load_config(REPO / "configs/tiny_cpu.yaml", ["train.stepz=3"])


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    bad = write(tmp_path / "bad.yaml", "optim:\n  lr: 0.1\n  warmup_step: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    msg = str(e.value)
    assert "optim.warmup_step" in msg and str(bad) in msg and "optim.warmup_steps" in msg


def test_error_names_the_file_that_set_the_key(tmp_path):
    write(tmp_path / "base.yaml", "train: {steps: -3}\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\noptim: {lr: 0.1}\n")
    with pytest.raises(ConfigError, match=r"base\.yaml: train\.steps: must be >= 0"):
        load_config(child)
    with pytest.raises(ConfigError, match="command line: optim.lr"):
        load_config(child, ["train.steps=1", "optim.lr=-1"])


@pytest.mark.parametrize("text, overrides, where, needle", [
    ("data: {augment: {std: [0.2, 0.2, 0.2]}}\n", ["data.augment.mean=[0.5,0.5]"], "command line",
     "data.augment.mean: needs 3 channels (R, G, B), got [0.5, 0.5]"),
    ("data: {augment: {mean: [0.5]}}\n", ["data.augment.std=[0.2,0.2,0.2]"], "file",
     "data.augment.mean: needs 3 channels (R, G, B), got [0.5]"),
    ("data: {augment: {mean: [0.5, 0.5, 0.5]}}\n", ["data.augment.std=[0.2,0.2]"], "command line",
     "data.augment.std: needs 3 channels (R, G, B), got [0.2, 0.2]"),
    ("data: {augment: {std: [0.2, 0.0, 0.2]}}\n", ["data.augment.mean=[0.4,0.4,0.4]"], "file",
     "data.augment.std: must be > 0 in every channel, got [0.2, 0.0, 0.2]"),
])
def test_normalisation_errors_name_the_key_and_where_it_was_set(tmp_path, text, overrides, where, needle):
    cfg = write(tmp_path / "norm.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(cfg, overrides)
    origin = "command line" if where == "command line" else str(cfg.resolve())
    assert str(e.value) == f"{origin}: {needle}"


@pytest.mark.parametrize("text, needle", [
    ("zero: {stage: 5}\n", "zero.stage"),
    ("train: {global_batch_size: 100, micro_batch_size: 32}\n", "train.global_batch_size"),
    ("model: {name: vit_base_patch16_224, img_size: 100}\n", "model.img_size: 100 must be a positive multiple"),
    ("train: {steps: -1}\n", "train.steps"),
    ("validation: {batch_size: -8}\n", "validation.batch_size: must be >= 0 (0: the training micro batch), got -8"),
    ("train: {steps: ten}\n", "train.steps: expected int"),
    ("train: {precision: fp8}\n", "train.precision"),
    ("logging: {wandb: {mode: loud}}\n", "logging.wandb.mode"),
    ("model: {name: vit_base_patch61_224}\n", "did you mean 'vit_base_patch16_224'"),
    ("data: {workers: 2.5}\n", "data.workers"),
    ("optim: {lr: .nan}\n", "optim.lr: expected a finite number, got nan"),
    ("optim: {weight_decay: .inf}\n", "optim.weight_decay: expected a finite number"),
    ("train: {hang_timeout_s: -.inf}\n", "train.hang_timeout_s: expected a finite number"),
])
def test_invalid_values_via_cli_exit_2_one_line(tmp_path, text, needle):
    bad = write(tmp_path / "bad.yaml", text)
    r = run_cli("--config", str(bad))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # one line, no traceback
    assert needle in lines[0] and "Traceback" not in r.stderr


@pytest.mark.parametrize("overrides, needle", [
    # values that the data workers, the optimizer, DeepSpeed or numpy would meet only in the run
    (["optim.lr=0.001", "optim.min_lr=0.01"], "optim.min_lr: must be in [0, optim.lr=0.001]"),
    (["optim.eps=0"], "optim.eps: must be > 0"),
    (["optim.momentum=1.0"], "optim.momentum: must be in [0, 1)"),
    (["data.augment.mixup_alpha=-0.2"], "data.augment.mixup_alpha: must be >= 0 (0: off), got -0.2"),
    (["data.augment.cutmix_alpha=-1.0"], "data.augment.cutmix_alpha: must be >= 0"),
    (["data.augment.randaugment_ops=2", "data.augment.randaugment_magnitude=40"],
     "data.augment.randaugment_magnitude: must be in 0-30"),
    (["data.augment.randaugment_ops=-1"], "data.augment.randaugment_ops: must be >= 0"),
    (["data.augment.hflip=1.5"], "data.augment.hflip: must be a probability in [0, 1], got 1.5"),
    (["data.augment.crop_ratio=[1.5,0.5]"], "data.augment.crop_ratio: must be [min, max]"),
    (["data.augment.eval_crop_pct=0"], "data.augment.eval_crop_pct: must be in (0, 1]"),
    (["data.shuffle_buffer=-1"], "data.shuffle_buffer: must be >= 0"),
    (["data.prefetch_factor=0"], "data.prefetch_factor: must be >= 1"),
    (["data.max_image_pixels=0"], "data.max_image_pixels: must be a positive number of pixels"),
    (["train.seed=-1"], "train.seed: must be >= 0"),
    (["eval.seed=-3"], "eval.seed: must be >= 0"),
    (["validation.seed=3"], "'validation.seed' is not a key: the few-shot draws are seeded 0 to "
                            "validation.fewshot_seeds - 1"),
    (["validation.minival_fraction=0.5"], "'validation.minival_fraction' is not a key: the probes fit each "
                                          "suite's whole train split"),
    (["train.max_nonfinite_steps=0"], "train.max_nonfinite_steps: must be >= 1"),
    (["train.activation_checkpointing=-1"], "train.activation_checkpointing: must be true, false, auto, selective "
                                            "or a number of blocks >= 0, got -1"),
    # the multi-label loss takes its targets as they are: a smoothing there would change nothing
    (["data.multi_label=true", "optim.label_smoothing=0.1"], "optim.label_smoothing: data.multi_label=true trains"),
    (["zero.allgather_bucket_size=0"], "zero.allgather_bucket_size: must be a positive number of elements"),
    (["zero.stage3_param_persistence_threshold=-1"], "zero.stage3_param_persistence_threshold: must be >= 0"),
    # what DeepSpeed or the engine would refuse only as the run starts, after vit-launch check passed it
    (["zero.reduce_bucket_size=0"], "zero.reduce_bucket_size: must be a positive number of elements or auto"),
    (["zero.stage=3", "zero.stage3_prefetch_bucket_size=-1"], "zero.stage3_prefetch_bucket_size: must be >= 0"),
    (["zero.stage=0", "zero.offload_optimizer=true"], "zero.offload_optimizer: needs zero.stage >= 1"),
    (["zero.offload_params=true"], "zero.offload_params: needs zero.stage=3 (parameters are partitioned only there), "
                                   "got zero.stage=2"),
    # ZeRO++ outside stage 3: DeepSpeed's config would leave it out and the run would not quantize
    (["zero.quantized_weights=true"], "zero.quantized_weights: is ZeRO++, which DeepSpeed runs only with zero.stage=3"),
    (["zero.stage=1", "zero.quantized_gradients=true"], "zero.quantized_gradients: is ZeRO++, which DeepSpeed runs"),
    # a fine-tune's schedule and every sweep grid, each named by its own key
    (["eval.protocol=finetune", "eval.lr=0.1", "eval.min_lr=0.5"], "eval.min_lr: must be in [0, eval.lr=0.1], got 0.5"),
    (["eval.protocol=finetune", "eval.sweep_lr=[0.1,1]", "eval.min_lr=0.5"],
     "eval.min_lr: must be in [0, the least of eval.sweep_lr=0.1], got 0.5"),
    (["eval.protocol=finetune", "eval.sweep_lr=[0.1,-1]"], "eval.sweep_lr: must list positive learning rates"),
    (["eval.sweep_linear_l2=[]"], "eval.sweep_linear_l2: must list L2 penalties >= 0, got []"),
    (["eval.sweep_linear_l2=[-1]"], "eval.sweep_linear_l2: must list L2 penalties >= 0, got [-1.0]"),
    (["eval.sweep_fewshot_l2=[]"], "eval.sweep_fewshot_l2: must list ridge penalties > 0, got []"),
    (["eval.sweep_fewshot_l2=[0]"], "command line: eval.sweep_fewshot_l2: must list ridge penalties > 0"),
    (["eval.watch_idle_timeout_s=-1"], "eval.watch_idle_timeout_s: must be >= 0 (0: evaluate what is there"),
    # VTAB-1k task names: known ones, and a vtab1k suite to read them
    (["eval.suite=vtab1k", "eval.tasks=[svhn,imagenet]"], "eval.tasks: unknown VTAB-1k task 'imagenet'; known: "),
    (["eval.tasks=[svhn]"], "eval.tasks: ['svhn'] would be ignored: only suite vtab1k reads it, and eval runs cifar1"),
    (["validation.fewshot_suites=[demo]", "validation.knn_suites=[demo,imagefolder:/f]", "validation.tasks=[dtd]"],
     "validation.tasks: ['dtd'] would be ignored: only suite vtab1k reads it, and validation runs demo, imagefolder"),
    (["validation.fewshot_suites=[vtab1k:/v]", "validation.tasks=[svhn,kitti,cifar10]"],
     "validation.tasks: unknown VTAB-1k task 'cifar10'"),
])
def test_values_the_run_would_meet_late_are_refused_at_load(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/tiny_cpu.yaml", overrides)
    assert needle in str(e.value), e.value


@pytest.mark.parametrize("override, message", [
    ("train.compile=null", "train.compile: expected bool | 'blocks' | 'model', got None"),
    ("train.activation_checkpointing=null",
     "train.activation_checkpointing: expected bool | int | 'auto' | 'selective', got None"),
    ("model.img_size=big", "model.img_size: expected int or null, got 'big'"),
])
def test_a_type_error_offers_null_only_where_null_is_accepted(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == f"command line: {message}"


def test_cli_unknown_key_missing_file_bad_yaml_bad_override(tmp_path):
    cases = [
        (["--config", str(write(tmp_path / "u.yaml", "modle: {name: x}\n"))], "did you mean 'model'"),
        (["--config", str(tmp_path / "nope.yaml")], "config file not found"),
        (["--config", str(write(tmp_path / "y.yaml", "model: [unclosed\n"))], "invalid YAML"),
        (["--config", str(REPO / "configs/tiny_cpu.yaml"), "optim.lr"], "expected KEY=VALUE"),
        (["--config", str(write(tmp_path / "c.yaml", "base: c.yaml\n"))], "cycle"),
    ]
    for args, needle in cases:
        r = run_cli(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert needle in r.stderr


def test_nan_is_refused_from_an_override_and_in_every_float_key():
    with pytest.raises(ConfigError, match="optim.lr: expected a finite number"):
        load_config(REPO / "configs/tiny_cpu.yaml", ["optim.lr=.nan"])
    import dataclasses
    import typing

    from pretrain.config.schema import Config

    def float_keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                yield from float_keys(tp, f"{prefix}{f.name}.")
            elif tp is float or float in typing.get_args(tp):
                yield prefix + ("async" if f.name == "async_save" else f.name)

    keys = list(float_keys(Config))
    assert len(keys) > 20
    for key in keys:
        with pytest.raises(ConfigError, match=f"{key}: expected a finite number"):
            load_config(None, [f"{key}=.inf"])


def test_non_utf8_yaml_and_unwritable_output_are_one_line(tmp_path):
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("# r\xe9sum\xe9\ntrain: {seed: 1}\n".encode("latin-1"))
    r = run_cli("--config", str(latin))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not UTF-8" in r.stderr, r.stderr
    (tmp_path / "a_file").write_text("x")
    for out in (tmp_path / "a_file" / "resolved.yaml", tmp_path):  # under a file; a folder
        r = run_cli("--config", str(REPO / "configs/tiny_cpu.yaml"), "--output", str(out))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--output" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    from launch.plot_scaling import main as plot_main

    with pytest.raises(SystemExit) as e:
        plot_main([str(tmp_path), "--output", str(tmp_path / "a_file" / "s.png")])
    assert e.value.code == 2


def test_an_output_that_is_the_config_read_is_refused_and_left(tmp_path, capsys):
    """``vit-config --output`` and ``vit-launch slurm --output`` naming the --config they read (by
    another path too) replaced it, with the resolved tree or with the sbatch script; now one line,
    the file as it was."""
    from launch.cli import main as launch_main
    from pretrain.config.cli import main as config_main

    cfg = tmp_path / "my.yaml"
    cfg.write_text("base: " + str(REPO / "configs/tiny_cpu.yaml") + "\n# my notes\ntrain: {seed: 3}\n")
    before = cfg.read_bytes()
    link = tmp_path / "same.yaml"
    link.symlink_to(cfg)
    said = "--output {}: is the --config file this command reads; writing would replace it: choose another --output"
    for run, prog, argv in ((config_main, "vit-config", []),
                            (launch_main, "vit-launch", ["slurm", "--nodes", "1", "--gpus-per-node", "0"])):
        for out in (cfg, link):
            with pytest.raises(SystemExit) as e:
                run([*argv, "--config", str(cfg), "--output", str(out)])
            assert (e.value.code, capsys.readouterr().err) == (2, f"{prog}: error: {said.format(out)}\n")
    assert cfg.read_bytes() == before


def test_cli_prints_resolved_config():
    r = run_cli("--config", str(REPO / "configs/tiny_cpu.yaml"), "train.seed=5")
    assert r.returncode == 0, r.stderr
    tree = yaml.safe_load(r.stdout)
    assert tree["train"]["seed"] == 5 and tree["zero"]["stage"] == 2


def test_resolved_config_round_trip(tmp_path):
    c = load_config(REPO / "configs/vit_l16_in21k.yaml", ["train.seed=3"])
    out = save_config(c, tmp_path / "run" / "config.yaml")
    again = load_config(out)
    assert to_dict(again) == to_dict(c)
    assert from_dict(to_dict(c)) == c


def test_world_size_divisibility():
    c = load_config(REPO / "configs/tiny_cpu.yaml")
    assert check_world_size(c.train, 2) == 1 and check_world_size(c.train, 1) == 2
    with pytest.raises(ConfigError, match="micro_batch_size x world size = 32 x 3"):
        check_world_size(c.train, 3)
    # the settings that work, as one suggestion: a micro batch where one divides, else a global batch
    t = dataclasses.replace(c.train, global_batch_size=96, micro_batch_size=32)
    with pytest.raises(ConfigError,
                       match=r"= 64; e\.g\. train\.micro_batch_size=24 or train\.global_batch_size=64 / 128$"):
        check_world_size(t, 2)
    t = dataclasses.replace(c.train, global_batch_size=4096, micro_batch_size=64)
    with pytest.raises(ConfigError, match=r"= 448; e\.g\. train\.global_batch_size=4032 / 4480$"):
        check_world_size(t, 7)


def test_evaluation_while_training_has_its_own_section(tmp_path):
    """validation.* is the training job's evaluation, eval.* vit-transfer's: the old keys get one line
    naming the new ones, and a config stored by an older checkpoint is read with the values moved."""
    from pretrain.config import from_dict, to_dict

    for old, new in (("eval.every_steps=5", "validation.every_steps"), ("eval.fewshot.suites=[demo]",
                                                                         "validation.fewshot_suites")):
        with pytest.raises(ConfigError, match=f"is now '{new}'"):
            load_config("configs/tiny_cpu.yaml", [old])
    stored = to_dict(load_config("configs/tiny_cpu.yaml"))
    # a config stored while validation held a minival split it never read: read without it
    stored["validation"].update(minival_fraction=0.02, seed=0)
    assert from_dict(stored) == load_config("configs/tiny_cpu.yaml")
    stored.pop("validation")
    stored["eval"].update(every_steps=7, fewshot={"suites": ["demo"]}, fewshot_shots=[2])
    cfg = from_dict(stored)
    assert cfg.validation.every_steps == 7 and cfg.validation.fewshot_suites == ["demo"]
    assert cfg.validation.fewshot_shots == [2] and cfg.eval.fewshot_shots == [2]


def test_eval_and_validation_share_the_fewshot_settings():
    """The few-shot keys both sections carry have one default and one check; lists are not shared
    between configs."""
    from pretrain.evaluation.config import FEWSHOT_DEFAULTS, EvalConfig, ValidationConfig

    ev, val = EvalConfig(), ValidationConfig()
    for key, default in FEWSHOT_DEFAULTS.items():
        assert getattr(ev, key) == default, key
        if key not in ("minival_fraction", "seed"):  # a sweep's split: vit-transfer's alone
            assert getattr(val, key) == default, key
    ev.fewshot_shots.append(50)
    assert ValidationConfig().fewshot_shots == EvalConfig().fewshot_shots == [1, 5, 10, 25]
    for section in ("eval", "validation"):
        with pytest.raises(ConfigError, match=f"{section}.fewshot_seeds: must be positive, got 0"):
            load_config("configs/tiny_cpu.yaml", [f"{section}.fewshot_seeds=0"])
    with pytest.raises(ConfigError, match=r"eval.minival_fraction: must be in \(0, 1\)"):
        load_config("configs/tiny_cpu.yaml", ["eval.minival_fraction=1.5"])


def test_keys_only_other_protocols_read_are_named_with_their_protocols(tmp_path):
    """One config serves every protocol: a key changed for one (in the file or an override) is named
    under another, with the protocols that read it; defaults, and keys the protocol reads, are not."""
    import typing

    from pretrain.evaluation.config import PROTOCOL_KEYS, EvalConfig, unread_keys_note

    fields = {f.name: f for f in dataclasses.fields(EvalConfig)}
    protocols = set(typing.get_args(typing.get_type_hints(EvalConfig)["protocol"]))
    assert set(PROTOCOL_KEYS) <= set(fields) and all(set(r) < protocols for r in PROTOCOL_KEYS.values())
    cfg_file = write(tmp_path / "e.yaml", "eval:\n  real_labels: real.json\n  fewshot_shots: [1, 5]\n")
    cfg = load_config(cfg_file, ["eval.protocol=linear", "eval.knn_k=[5]", "eval.linear_l2=0.1"])
    assert unread_keys_note(cfg.eval) == ("eval.protocol=linear ignores eval.fewshot_shots (read by fewshot); "
                                          "eval.knn_k (read by knn); eval.real_labels (read by head)")
    assert unread_keys_note(load_config(cfg_file, ["eval.protocol=head"]).eval) == (
        "eval.protocol=head ignores eval.fewshot_shots (read by fewshot)")
    for protocol in sorted(protocols):  # the defaults, set again by hand, are no change
        assert unread_keys_note(load_config(None, [f"eval.protocol={protocol}", "eval.knn_k=[10,20,100,200]",
                                                   "eval.fewshot_l2=1024", "eval.steps=500"]).eval) is None
    assert unread_keys_note(load_config(None, ["eval.protocol=knn", "eval.steps=5", "eval.warmup_steps=1",
                                               "eval.pool=avg"]).eval) == (
        "eval.protocol=knn ignores eval.steps, eval.warmup_steps (read by finetune)")


def test_deepspeed_prints_the_config_deepspeed_parses(tmp_path, capsys):
    """``--deepspeed --world-size N``: the JSON a run hands DeepSpeed, read back by DeepSpeed's own
    parser (here a world of one); the world size sets the accumulation; without it, one line."""
    import json

    from deepspeed.runtime.config import DeepSpeedConfig

    from pretrain.config import cli as config_cli

    tiny = str(REPO / "configs/tiny_cpu.yaml")
    out = tmp_path / "ds.json"
    r = run_cli("--config", tiny, "--deepspeed", "--world-size", "1", "--output", str(out), "optim.grad_clip=0",
                "zero.stage=3", "zero.offload_params=true", "deepspeed.comms_logger.enabled=true")
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["comms_logger"] == {"enabled": True}  # the deepspeed: pass-through
    parsed = DeepSpeedConfig(json.loads(out.read_text()))
    assert parsed.gradient_clipping == 0.0 and parsed.zero_config.stage == 3
    assert parsed.zero_config.offload_param.device == "cpu" and parsed.zero_config.offload_param.pin_memory
    assert parsed.zero_config.offload_optimizer is None
    assert parsed.train_micro_batch_size_per_gpu == 32 and parsed.gradient_accumulation_steps == 2
    r = run_cli("--config", tiny, "--deepspeed", "--world-size", "2")
    assert r.returncode == 0, r.stderr
    two = json.loads(r.stdout)
    assert (two["train_batch_size"], two["gradient_accumulation_steps"], two["gradient_clipping"]) == (64, 1, 1.0)
    # each mistake is the one line on stderr: no usage block, no DeepSpeed log line before it
    r = run_cli("--config", tiny, "--deepspeed")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "vit-config: error: --deepspeed needs --world-size N: the ranks set the gradient accumulation"], r.stderr
    r = run_cli("--config", tiny, "--world-size", "2")  # the resolved config would print, the ranks unread
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "vit-config: error: --world-size is for --deepspeed (the DeepSpeed JSON of a run on that many ranks)"], r.stderr
    r = run_cli("--config", tiny, "--deepspeed", "--world-size", "1", "deepspeed.zero_optimization.stag3=1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(
        "vit-config: error: deepspeed: DeepSpeed refuses the merged config:"), r.stderr
    r = run_cli("--config", tiny, "--deepspeed", "--world-size", "3")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "3" in r.stderr, r.stderr
    for ranks in ("0", "-2"):  # a world given but below one is named as given, not taken for none
        with pytest.raises(SystemExit) as e:
            config_cli.main(["--config", tiny, "--deepspeed", "--world-size", ranks])
        said = f"vit-config: error: --world-size {ranks}: must be >= 1\n"
        assert (e.value.code, capsys.readouterr().err) == (2, said)
