"""Transfer evaluation of pre-trained ViTs: CIFAR-100, VTAB-1k, ImageFolder, shards and the demo set,
by fine-tuning, linear probe, few-shot, kNN and the checkpoint's own head (``vit-transfer``; see
``cli.py``; what each protocol does and who reports it so: ``pretrain/evaluation/EVALUATION.md``).

    suites.py       --data-root -> Task (train / val / trainval / test splits); vtab.py: tasks, groups
                    (any checkpoint -> weights and architecture: ``pretrain.weights.pretrained``)
    data.py         splits that yield (images, labels) tensors; View: resolution, crop, augmentation
    protocols/      fine-tuning (paper and deit recipes); linear probe, few-shot and kNN on frozen
                    features extracted once per split; the checkpoint's own head
    sweep.py        select on train -> val, retrain on train + val, score on test
    evaluate.py     one checkpoint x suite x protocol -> results document
    results.py      JSON, Markdown table, W&B;  watch.py: --watch RUN_DIR

Imports stay lazy here: ``import pretrain.transfer`` costs nothing.
"""
