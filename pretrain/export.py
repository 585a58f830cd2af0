"""``python -m pretrain.export RUN OUT [--format timm|hf]``: the export command at its documented
path (``pretrain/weights/export.py``)."""
from pretrain.weights.export import export, export_hf, main

__all__ = ["export", "export_hf", "main"]

if __name__ == "__main__":
    main()
