"""The transfer protocols, each an object with ``name``, ``grid(sweep)`` and ``fit_score(task, fit,
evaluate, setting)`` (``pretrain.transfer.sweep`` runs them):

    features.py     frozen features, extracted once per split, shared by the next three
    linear.py       logistic regression on frozen features (linear probe)
    fewshot.py      big_vision's closed-form few-shot ridge regression
    knn.py          DINOv2's weighted k-nearest-neighbour vote
    head.py         the checkpoint's own classifier (top-1 / top-5, ReaL)
    finetune.py     fine-tuning with a new head; recipes.py its two recipes (paper, deit);
                    ema.py the EMA of its weights
"""
