"""The transfer protocols, each an object with ``name``, ``grid(sweep)`` and ``fit_score(task, fit,
evaluate, setting)`` (``pretrain.transfer.sweep`` runs them):

    features.py     frozen features, extracted once per split, shared by the next two
    linear.py       logistic regression on frozen features (linear probe)
    fewshot.py      big_vision's closed-form few-shot ridge regression
    finetune.py     fine-tuning with a new head
"""
