"""A batch between its worker and the training step: what crosses (``wire.py``) in reused shared
memory (``buffers.py``) with its record (``record.py``), and how the training process finishes it
(``decode.py``: decode, crop with ``crop_atlas.py``, normalise, mix; one batch ahead on a GPU:
``prefetch.py``)."""
