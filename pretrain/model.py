"""The model API at its documented path: ``pretrain.model.create_model(name, ...)`` builds the
timm-named ViT variants (the family lives in ``pretrain/models/``)."""
from pretrain.models.arch import list_models, model_defaults, register
from pretrain.models.tokens import resize_pos_embed
from pretrain.models.vit import VisionTransformer, create_model

__all__ = ["create_model", "list_models", "model_defaults", "register", "resize_pos_embed", "VisionTransformer"]
