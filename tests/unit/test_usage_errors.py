"""Every command answers a usage mistake (an option it does not know, a required one missing) with
one line naming itself and exit 2, before any work: argparse's usage block is left to ``--help``
(``data_pipeline.errors.Parser``). The console scripts are read from setup.py, so a new one is
held to it too."""
import importlib

import pytest
from dist_utils import console_scripts

# commands run as modules, beside the console scripts: {what each calls itself: its module}
MODULES = {"vit-elastic": "pretrain.checkpointing.elastic", "vit-demo": "launch.demo",
           "plot_scaling": "launch.plot_scaling", "python -m data_pipeline.loading.plan": "data_pipeline.loading.plan"}


@pytest.mark.parametrize("name,module,argv", [
    *[(n, target.partition(":")[0], ["--no-such-option"]) for n, target in console_scripts().items()],
    *[(n, m, ["--no-such-option"]) for n, m in MODULES.items()],
    ("vit-launch plan", "launch.cli", ["plan", "--no-such-option"]),
])
def test_a_usage_mistake_is_one_line(capsys, name, module, argv):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert len(err) == 1 and err[0].startswith(f"{name}: error: "), err
