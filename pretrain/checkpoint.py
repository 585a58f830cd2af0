"""Checkpoints: weights import (``load_weights``); save / resume / export arrive with training."""
from pretrain.weights import LoadReport, WeightsError, load_weights, read_state_dict

__all__ = ["load_weights", "read_state_dict", "LoadReport", "WeightsError"]
