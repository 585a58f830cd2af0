"""Bad input to every command, each answered with one line naming the file, key or value, exit 2,
before any work and with nothing written: config files, overrides, shard sources and part
manifests, launch options, the audit's and the demo's arguments. In-process calls of each
command's ``main`` (one line on stderr, the exit code) or of the function that owns the check."""
import json
from pathlib import Path

import pytest

from pretrain.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/tiny_cpu.yaml"


def one_line(capsys, main, argv, code=2) -> str:
    """Run a command's ``main(argv)``: it exits ``code`` with exactly one line on stderr; that line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == code and len(err) == 1, (e.value.code, err)
    return err[0]


# ------------------------------------------------------------------------------ config files
@pytest.mark.parametrize("text,needle", [
    ("optim:\n  lr: 0.1\noptim:\n  weight_decay: 0.0\n",
     "line 3 invalid YAML: duplicate key 'optim' (first on line 1)"),
    ("optim:\n  lr: 0.1\n  lr: 0.2\n", "line 3 invalid YAML: duplicate key 'lr' (first on line 2)"),
    ("optim: {lr: 0.1, lr: 0.2}\n", "line 1 invalid YAML: duplicate key 'lr' (first on line 1)"),
])
def test_a_key_written_twice_is_refused_not_the_last_one_kept(tmp_path, text, needle):
    """PyYAML keeps the last of two equal keys: a second `optim:` section silently dropped the first."""
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value) == f"{f}: {needle}"


def test_a_merge_key_may_be_overridden(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  <<: {lr: 0.5, weight_decay: 0.0}\n  lr: 0.25\n")
    cfg = load_config(f)
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (0.25, 0.0)


@pytest.mark.parametrize("base,needle", [
    ("missing.yaml", "base: {dir}/missing.yaml: config file not found"),
    ("sub", "base: {dir}/sub: config file not found"),
    ('""', "'base' must be a file name or a list of them, got ''"),
])
def test_a_base_that_is_not_a_file_names_the_file_asking_for_it(tmp_path, base, needle):
    (tmp_path / "sub").mkdir()
    f = tmp_path / "c.yaml"
    f.write_text(f"base: {base}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value) == f"{f}: " + needle.format(dir=tmp_path)


@pytest.mark.parametrize("override,needle", [
    ("train.seed=18446744073709551615", "train.seed: must be below 2**63"),
    ("eval.seed=9223372036854775808", "eval.seed: must be below 2**63"),
    ("train.output_dir=", "train.output_dir: is empty"),
])
def test_values_a_run_would_meet_late_are_refused_at_load(override, needle):
    """A seed past 64 bits ended the run in torch.manual_seed with a traceback; an empty output
    folder put the whole run (checkpoints, metrics) into the folder the command ran in."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert str(e.value).startswith(f"command line: {needle}"), e.value


def test_a_batch_that_does_not_divide_names_its_key_once_with_one_suggestion():
    """The key came twice (`train.global_batch_size: train.global_batch_size=65 ...`), and vit-launch
    check added a second suggestion after the first (`e.g. ...; set ...`)."""
    from launch.preflight import check_batch

    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["train.global_batch_size=65"])
    assert str(e.value) == ("command line: train.global_batch_size=65 is not divisible by train.micro_batch_size "
                            "x world size = 32 x 1 = 32; e.g. train.micro_batch_size=13 or train.global_batch_size="
                            "64 / 96")
    (finding,) = check_batch(load_config(TINY), 3)
    assert finding.line() == ("batch: train.global_batch_size=64 is not divisible by train.micro_batch_size x "
                              "world size = 32 x 3 = 96; e.g. train.global_batch_size=96")


def test_the_largest_seed_loads():
    assert load_config(TINY, ["train.seed=9223372036854775807"]).train.seed == 2**63 - 1


# -------------------------------------------------------------------------------- vit-shards
@pytest.mark.parametrize("size", ["inf", "nan", "-1", "0", "1e99999"])
def test_shards_a_shard_size_limit_that_is_not_a_size(capsys, tmp_path, size):
    """inf was a traceback; 0 set no limit and -1 closed a shard after every sample."""
    from data_pipeline.shards.cli import main

    line = one_line(capsys, main, ["--source", "demo", "--output", str(tmp_path / "o"), "--max-shard-bytes", size])
    assert line == ("vit-shards: error: argument --max-shard-bytes: expected a positive size like 500000000 or 1G, "
                    f"got {size!r}")
    assert not (tmp_path / "o").exists()


def test_shards_an_empty_output_writes_nothing_here(capsys, tmp_path, monkeypatch):
    """`--output ''` (an unset shell variable) wrote the shards into the current folder."""
    from data_pipeline.shards.cli import main

    monkeypatch.chdir(tmp_path)
    line = one_line(capsys, main, ["--source", "demo", "--output", "", "--limit", "4", "--quiet"])
    assert line.startswith("vit-shards: error: argument --output: empty")
    assert not list(tmp_path.iterdir())


def test_shards_a_file_list_that_is_not_text_names_its_line(capsys, tmp_path):
    """A file list in another encoding (or a binary file) was a UnicodeDecodeError traceback."""
    from data_pipeline.shards.cli import main

    lst = tmp_path / "list.txt"
    lst.write_bytes(b"a.jpg\t0\nb\xe9.jpg\t1\n")
    line = one_line(capsys, main, ["--source", f"filelist:{lst}", "--output", str(tmp_path / "o"), "--quiet"])
    assert line == (f"vit-shards: error: {lst}:2: not UTF-8 text (byte 0xe9); a file list is lines of "
                    "'path<TAB>label[,label...]'")


@pytest.fixture(scope="module")
def two_parts(tmp_path_factory):
    """The demo's first 16 samples written as parts 1/2 and 2/2: (folder, part 1's manifest)."""
    from data_pipeline.shards.cli import main

    out = tmp_path_factory.mktemp("parts")
    for part in ("1/2", "2/2"):
        assert main(["--source", "demo", "--output", str(out), "--limit", "16", "--shard-size", "4",
                     "--part", part, "--quiet"]) == 0
    return out, json.loads((out / "part-0001of0002.json").read_text())


def _broken(m: dict, key: str, value) -> dict:
    m = json.loads(json.dumps(m))
    if key.startswith("shards[0]."):
        m["shards"][0][key.removeprefix("shards[0].")] = value
    elif value is None:
        m.pop(key)
    else:
        m[key] = value
    return m


@pytest.mark.parametrize("key,value,needle", [
    ("shards", None, "shards: expected a list of shards, got None"),
    ("shards", 5, "shards: expected a list of shards, got 5"),
    ("shards[0].samples", "x", "shards[0]: expected {'name': file name, 'samples': int >= 0, 'bytes': int >= 0}"),
    ("shards[0].name", 5, "shards[0]: expected {'name': file name"),
    ("shards[0].name", "../x.tar", "shards[0]: expected {'name': file name"),
    ("part", "x", "part: expected a part number in 1..parts, got 'x'"),
    ("range", [0], "range: expected [first sample, end], got [0]"),
    ("skipped", "x", "skipped: expected {reason: count}, got 'x'"),
])
def test_merge_a_part_manifest_with_a_wrong_field_names_it(capsys, tmp_path, two_parts, key, value, needle):
    """A part manifest edited by hand or cut short was a KeyError or TypeError traceback."""
    from data_pipeline.shards.cli import main

    out, m = two_parts
    bad = tmp_path / "part-0001of0002.json"
    bad.write_text(json.dumps(_broken(m, key, value)))
    line = one_line(capsys, main, ["merge", str(out), str(bad), str(out / "part-0002of0002.json")])
    assert line.startswith(f"vit-shards merge: error: {bad}: {needle}"), line
    assert line.endswith(": not a part manifest as vit-shards --part writes it")
    assert not (out / "manifest.json").exists()


# -------------------------------------------------------------------------------- vit-launch
@pytest.mark.parametrize("argv,needle", [
    (["check", "--config", str(TINY), "--world-size", "2", "--gpu-memory-gb", "inf"],
     "vit-launch check: error: argument --gpu-memory-gb: must be a number of GB above 0, got 'inf'"),
    (["plan", "--model", "vit_base_patch16_224", "--gpu", "h100-sxm", "--intra-node-gbps", "inf"],
     "vit-launch: error: --intra-node-gbps inf (must be finite)"),
    (["plan", "--model", "vit_base_patch16_224", "--gpu", "h100-sxm", "--decode-rate", "inf", "--json"],
     "vit-launch: error: --decode-rate inf (must be finite)"),
])
def test_launch_an_infinite_number_is_refused(capsys, argv, needle):
    """inf passed the checks that refused nan; plan --json then printed `Infinity`, which JSON readers refuse."""
    from launch.cli import main

    assert one_line(capsys, main, argv) == needle


@pytest.mark.parametrize("flag", ["--include", "--exclude"])
def test_launch_include_without_a_hostfile_names_the_missing_hostfile(capsys, flag):
    """Without --hostfile the error blamed --num-nodes/--gpus-per-node, which nobody had given."""
    from launch.cli import main

    line = one_line(capsys, main, ["check", "--config", str(TINY), flag, "worker-0"])
    assert line == "vit-launch: error: --include/--exclude need --hostfile"


# ------------------------------------------------------------------------------ plot_scaling
KINDS = ".avif, .eps, .gif, .jpeg, .jpg, .pdf, .pgf, .png, .ps, .raw, .rgba, .svg, .svgz, .tif, .tiff, .webp"


@pytest.mark.parametrize("name,got", [("p.txt", "extension .txt"), ("scaling", "no extension")])
def test_plot_an_output_matplotlib_cannot_write_is_refused_before_the_runs(capsys, tmp_path, name, got):
    """A .txt plot was a matplotlib ValueError traceback after every run was read; no extension
    wrote `scaling.png` while the command said `plot: scaling`. The run folder here does not
    exist: the output is checked first."""
    from launch.plot_scaling import main

    out = tmp_path / name
    line = one_line(capsys, main, [str(tmp_path / "no-run"), "--output", str(out)])
    assert line == f"plot_scaling: error: --output {out}: {got}; a plot file ends in one of {KINDS}"


def test_plot_the_output_check_names_the_option_it_is_given(tmp_path):
    """`vit-launch sweep --plot` can run the same check before its first job, naming its own option."""
    from launch.plot_scaling import check_plot_output

    (tmp_path / "f").write_text("")
    for path, needle in [(tmp_path / "p.txt", "extension .txt"), (tmp_path, "a folder, not a file"),
                         (tmp_path / "f/p.png", f"{tmp_path}/f is a file, not a folder; choose a writable --plot")]:
        with pytest.raises(ConfigError) as e:
            check_plot_output(path, "--plot")
        assert str(e.value).startswith(f"--plot {path}: {needle}"), e.value
    check_plot_output(tmp_path / "P.PDF", "--plot")


# --------------------------------------------------------------------------------- vit-audit
@pytest.fixture()
def no_hashing(monkeypatch):
    """vit-audit with its hashing of the training shards replaced by a record that it started."""
    from pretrain.evaluation import audit

    started = []
    monkeypatch.setattr(audit, "train_index", lambda *a, **k: started.append(a))
    return audit.main, started


@pytest.mark.parametrize("spec,needle", [
    ("nosuch:{dir}", "--eval nosuch:{dir}: unknown suite 'nosuch'; known: cifar100, imagefolder, shards, vtab1k"),
    ("cifar100:{dir}/missing", "{dir}/missing: not found (--eval cifar100:{dir}/missing)"),
    ("vtab1k:https://host/vtab", "--eval vtab1k:https://host/vtab: vtab1k reads a local folder"),
])
def test_audit_an_eval_set_it_cannot_read_is_refused_before_the_hashing(capsys, tmp_path, no_hashing, spec, needle):
    """The --eval sets were checked only after every training shard was hashed (hours on a large set)."""
    main, started = no_hashing
    spec, needle = spec.format(dir=tmp_path), needle.format(dir=tmp_path)
    line = one_line(capsys, main, ["--shards", str(tmp_path), "--eval", f"shards:{tmp_path}", "--eval", spec,
                                   "--output", str(tmp_path / "out"), "--quiet"])
    assert line.startswith(f"vit-audit: error: {needle}"), line
    assert started == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("option,value,needle", [
    ("--workers", "0", "--workers 0: must be >= 1"),
    ("--workers", "-2", "--workers -2: must be >= 1"),
    ("--grid", "-1", "--grid -1: must be >= 0 (0: no pairs drawn)"),
])
def test_audit_a_count_out_of_range_is_refused(capsys, tmp_path, no_hashing, option, value, needle):
    """--grid -1 drew every pair but the last; --workers 0 and -2 hashed in one process as if 1 were given."""
    main, started = no_hashing
    line = one_line(capsys, main, ["--shards", str(tmp_path), "--eval", f"shards:{tmp_path}", "--output",
                                   str(tmp_path / "out"), "--quiet", option, value])
    assert line == f"vit-audit: error: {needle}"
    assert started == []


# ---------------------------------------------------------------------------------- vit-demo
@pytest.mark.parametrize("sub", ["", "demo"])
def test_demo_an_out_that_is_a_file_is_one_line_before_any_step(capsys, tmp_path, sub):
    """The first step's child said it, then the demo said "step failed", exit 1."""
    from launch.demo import main

    (tmp_path / "f").write_text("")
    out = tmp_path / "f" / sub if sub else tmp_path / "f"
    line = one_line(capsys, main, ["--out", str(out), "--samples", "8"])
    assert line == (f"vit-demo: error: --out {out}: {tmp_path / 'f'} is a file, not a folder; "
                    "choose a writable --out folder")


# ------------------------------------------------------------------------ empty path options
@pytest.mark.parametrize("module,argv,name", [
    ("launch.cli", ["slurm", "--config", str(TINY), "--nodes", "1", "--gpus-per-node", "1", "--output", "{dir}/j.sh",
                    "--log-dir", ""], "vit-launch slurm: error: argument --log-dir"),
    ("launch.cli", ["check", "--config", str(TINY), "--hostfile", ""], "vit-launch check: error: argument --hostfile"),
    ("launch.cli", ["run", "--config", ""], "vit-launch: error: argument --config"),
    ("pretrain.weights.export", ["", "{dir}/out.safetensors"], "vit-export: error: argument run_dir"),
    ("pretrain.weights.export", ["{dir}", ""], "vit-export: error: argument output"),
    ("pretrain.transfer.cli", ["--checkpoint", "", "--suite", "demo"], "vit-transfer: error: argument --checkpoint"),
    ("pretrain.transfer.cli", ["--watch", "", "--suite", "demo"], "vit-transfer: error: argument --watch"),
    ("pretrain.transfer.cli", ["--checkpoint", "{dir}", "--suite", "demo", "--output", " "],
     "vit-transfer: error: argument --output"),
    ("pretrain.config.cli", ["--config", str(TINY), "--output", ""], "vit-config: error: argument --output"),
    ("pretrain.checkpointing.elastic", [""], "vit-elastic: error: argument checkpoint"),
    ("pretrain.evaluation.audit", ["--index", ""], "vit-audit: error: argument --index"),
    ("launch.plot_scaling", ["{dir}", ""], "plot_scaling: error: argument RUN_DIR"),
    ("launch.demo", ["--out", ""], "vit-demo: error: argument --out"),
    ("data_pipeline.shards.cli", ["merge", "", "{dir}/part-0001of0001.json"], "vit-shards merge: error: argument OUT"),
])
def test_an_empty_path_is_not_the_current_folder(capsys, tmp_path, monkeypatch, module, argv, name):
    """'' (an unset shell variable) was read as the current folder: slurm wrote its logs there,
    export and transfer looked for a checkpoint there, --watch '' was a TypeError traceback."""
    import importlib

    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(module).main
    line = one_line(capsys, main, [a.format(dir=tmp_path) for a in argv])
    assert line == f"{name}: empty; name a file or folder"
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------- data.train_shards
@pytest.mark.parametrize("name,what", [("garbage.yaml", "not a shard set"), ("nosuchdir", "not found")])
def test_shards_a_value_that_is_no_shard_set_is_named_not_a_manifest_beside_it(tmp_path, name, what):
    """The manifest.json beside the value was named, a file the user never gave."""
    from data_pipeline.shards.manifest import resolve_shards

    (tmp_path / "garbage.yaml").write_text("a: 1\n")
    with pytest.raises(ConfigError) as e:
        resolve_shards(str(tmp_path / name))
    assert str(e.value) == (f"data.train_shards: {tmp_path / name}: {what}; expected vit-shards' manifest.json, the "
                            "folder holding it or .tar shards listed in it")


# -------------------------------------------------------------------------------- vit-export
def test_export_a_damaged_marker_is_said_once(capsys, tmp_path):
    """A warning ("damaged ...; falling back to the one before it", with none before it) came
    before the error, which named the same damage again."""
    from pretrain.weights.export import main

    ckpt = tmp_path / "run" / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text('{"step": 10, "files": {"x": [1')
    line = one_line(capsys, main, [str(tmp_path / "run"), str(tmp_path / "out.safetensors")])
    assert line.startswith(f"vit-export: error: {tmp_path / 'run'}: no intact complete checkpoint in "
                           f"{tmp_path / 'run/checkpoints'}; damaged: {ckpt / 'COMPLETE'}: unreadable marker ("), line


def test_a_damaged_checkpoint_passed_over_is_said_by_the_command_reading_it(capsys, tmp_path):
    """vit-transfer reads run directories through vit-export's loader, whose warning for the damaged
    newest checkpoint it falls back past was labelled vit-export."""
    from transfer_fixtures import tiny_model, write_run_dir

    from pretrain.transfer.cli import main as transfer
    from pretrain.weights.export import main as export

    run = write_run_dir(tmp_path / "run", tiny_model(32), {10: True, 20: True}, final=20)
    newest = run / "checkpoints" / "step_00000020"
    (newest / "COMPLETE").write_text(json.dumps({"step": 20, "files": {"mp_rank_00_model_states.pt": [1, None]}}))
    warning = "warning: checkpoint step_00000020 is damaged ("
    export([str(run), str(tmp_path / "out.safetensors")])
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"vit-export: {warning}"), err
    with pytest.raises(SystemExit) as e:  # past the loading, it stops at the missing data
        transfer(["--checkpoint", str(run), "--protocol", "head", "--data-root", str(tmp_path / "none"),
                  "--output", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 2, err
    assert err[0].startswith(f"vit-transfer: {warning}") and err[1].startswith("vit-transfer: error: "), err


EXPECTED_HF = "a transformers ViT folder's config.json is a JSON object with model_type 'vit'"


@pytest.mark.parametrize("text,needle", [
    ('{"model_type": "vit",', "invalid JSON at line 1: Expecting property name enclosed in double quotes; "
                              + EXPECTED_HF),
    ('["vit"]', "a JSON list; " + EXPECTED_HF),
    ('{"model_type": "bert"}', "model_type 'bert'; " + EXPECTED_HF),
    ("{}", "no model_type; " + EXPECTED_HF),
    ('{"model_type": "vit", "patch_size": null}', "patch_size=None; expected a positive integer or [height, width]"),
    ('{"model_type": "vit", "hidden_size": "768"}', "hidden_size='768'; expected a positive integer"),
    ('{"model_type": "vit", "id2label": 5}', 'id2label=5; expected an object {"0": "name", ...}'),
])
def test_a_transformers_folder_with_a_bad_config_names_its_config_json(capsys, tmp_path, text, needle):
    """It was read as a run directory: "no intact complete checkpoint in DIR/checkpoints", or a
    TypeError traceback for a null patch_size."""
    import torch
    from safetensors.torch import save_file

    from pretrain.weights.export import main
    from pretrain.weights.pretrained import CheckpointError, load_pretrained

    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"x": torch.zeros(1)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(text)
    line = one_line(capsys, main, [str(folder), str(tmp_path / "out.safetensors")])
    assert line == f"vit-export: error: {folder / 'config.json'}: {needle}"
    with pytest.raises(CheckpointError) as e:  # vit-transfer --checkpoint, vit-analyze --checkpoint
        load_pretrained(folder)
    assert str(e.value).endswith(f"{folder / 'config.json'}: {needle}"), e.value


@pytest.mark.parametrize("tensors", ["bert", "none"])
@pytest.mark.parametrize("fmt", ["timm", "hf"])
def test_a_transformers_folder_without_vit_tensors_is_refused_by_export_as_by_transfer(capsys, tmp_path, tensors,
                                                                                         fmt):
    """A valid ViT config.json beside another model's weights (or none): vit-export wrote an
    "exported" file of them; vit-transfer refused it. Both read it through the same loader now."""
    import torch
    from safetensors.torch import save_file

    from pretrain.weights.export import main
    from pretrain.weights.pretrained import CheckpointError, load_pretrained

    folder = tmp_path / "hf"
    folder.mkdir()
    sd = {"bert.embeddings.word_embeddings.weight": torch.zeros(8, 192)} if tensors == "bert" else {}
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 192, "num_hidden_layers": 12,
                                                    "num_attention_heads": 3, "intermediate_size": 768,
                                                    "image_size": 32}))
    out = tmp_path / ("out.safetensors" if fmt == "timm" else "out")
    needle = f"{folder / 'model.safetensors'}: holds no ViT tensors ({'bert.' if tensors == 'bert' else 'no tensors'}"
    line = one_line(capsys, main, [str(folder), str(out), "--format", fmt])
    assert line.startswith(f"vit-export: error: {needle}"), line
    assert not out.exists()
    with pytest.raises(CheckpointError, match="holds no ViT tensors") as e:  # vit-transfer, vit-analyze
        load_pretrained(folder)
    assert needle in str(e.value), e.value
