"""``python -m data_pipeline.audit ...`` = ``vit-audit ...`` (its old path; the command sits above the
transfer suites whose readers it uses: ``pretrain/evaluation/audit.py``)."""
import sys

from pretrain.evaluation.audit import main

sys.exit(main())
