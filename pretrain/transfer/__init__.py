"""Transfer evaluation of pre-trained ViTs: CIFAR-100, VTAB-1k, ImageFolder, shards and the demo set,
by fine-tuning, linear probe and few-shot (``vit-transfer``; see ``cli.py``).

    suites.py       --data-root -> Task (train / val / trainval / test splits); vtab.py: tasks, groups
                    (any checkpoint -> weights and architecture: ``pretrain.weights.pretrained``)
    data.py         splits that yield (images, labels) tensors; View: resolution, crop, augmentation
    protocols/      fine-tuning; linear probe and few-shot on frozen features extracted once per split
    sweep.py        select on train -> val, retrain on train + val, score on test
    evaluate.py     one checkpoint x suite x protocol -> results document
    results.py      JSON, Markdown table, W&B;  watch.py: --watch RUN_DIR

Imports stay lazy here: ``import pretrain.transfer`` costs nothing.
"""
