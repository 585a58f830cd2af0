"""The config reference is generated from the schema's field docstrings: the committed
``pretrain/config/REFERENCE.md`` is the generator's output, every key of a resolved config has a
description, and ``vit-config --reference`` prints it."""
import subprocess
import sys
from pathlib import Path

from pretrain.config import load_config, to_dict
from pretrain.config.reference import field_docs, flatten, reference, yaml_key

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_reference_is_the_generated_one():
    committed = (REPO / "pretrain/config/REFERENCE.md").read_text()
    assert committed == reference(), "run: vit-config --reference > pretrain/config/REFERENCE.md"


def test_every_key_of_a_resolved_config_is_described():
    keys = flatten(to_dict(load_config(None)))
    docs = field_docs()
    missing = sorted(k for k in keys if not docs.get(k, "").strip())
    assert not missing, f"fields without a docstring: {missing}"
    table = reference()
    assert all(f"| `{yaml_key(k)}` |" in table for k in keys)
    assert "| `checkpoint.async` |" in table and "| `data.augment.crop_scale` |" in table
    assert "| `logging.wandb.mode` |" in table


def test_vit_config_reference_runs_as_a_command():
    out = subprocess.run([sys.executable, "-m", "pretrain.config", "--reference"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == reference()
