"""``python -m launch ...`` is ``vit-launch ...``."""
from launch.cli import main

main()
