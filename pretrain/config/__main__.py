"""``python -m pretrain.config`` = ``vit-config``."""
from pretrain.config.cli import main

main()
