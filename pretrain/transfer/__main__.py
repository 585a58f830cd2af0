"""``python -m pretrain.transfer`` = ``vit-transfer``."""
from pretrain.transfer.cli import main

if __name__ == "__main__":
    main()
