"""Each transfer protocol learns a learnable synthetic task far above chance: the solvers on
separable features, then end to end from a checkpoint through images (colour-square classes,
4 classes: chance is 25%). Also the resolution-change path of fine-tuning."""
import numpy as np
import pytest
import torch
from transfer_fixtures import exported_metadata, save_safetensors, tiny_model, write_imagefolder

from pretrain.config import load_config
from pretrain.models.tokens import resize_pos_embed
from pretrain.transfer.evaluate import evaluate_checkpoint
from pretrain.transfer.protocols.fewshot import fewshot_accuracy, ridge_fit, sample_shots, short_classes
from pretrain.transfer.protocols.finetune import Dist
from pretrain.transfer.protocols.linear import fit_logistic
from pretrain.transfer.suites import imagefolder
from pretrain.weights.pretrained import build_backbone, load_pretrained


def _clusters(n_per_class: int, classes: int = 5, dim: int = 64, seed: int = 0, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g) * 3
    y = torch.arange(classes).repeat_interleave(n_per_class)
    return centres[y] + spread * torch.randn(len(y), dim, generator=g), y


# ------------------------------------------------------------------------------------ solvers
def test_fewshot_ridge_is_far_above_chance_and_uses_the_test_labels():
    Xall, yall = _clusters(70, seed=0)
    Xtr, ytr, Xte, yte = Xall[::2], yall[::2], Xall[1::2], yall[1::2]
    acc = fewshot_accuracy(Xtr, ytr, Xte, yte, num_classes=5, shots=[1, 5], seeds=3, l2=1024.0)
    assert set(acc) == {1, 5} and all(len(v) == 3 for v in acc.values())
    assert np.mean(acc[5]) > 0.95 and np.mean(acc[1]) > 0.6  # chance: 0.2
    shuffled = yte[torch.randperm(len(yte), generator=torch.Generator().manual_seed(1))]
    assert np.mean(fewshot_accuracy(Xtr, ytr, Xte, shuffled, 5, [5], 3, 1024.0)[5]) < 0.45


def test_ridge_dual_form_equals_the_primal_solution():
    """With fewer points than dimensions the solver takes the dual route; its predictions must be
    those of the textbook primal ridge solution on the same whitened, bias-padded features."""
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(12, 40, generator=g), torch.arange(12) % 4
    Xt = torch.randn(200, 40, generator=g)
    pred = ridge_fit(X, y, 4, l2=3.0)(Xt)
    Xn = X.double().numpy()  # the reference: numpy, the textbook primal solve
    mean, std = Xn.mean(0), Xn.std(0) + 1e-5
    pad = lambda A: np.hstack([(A.double().numpy() - mean) / std, np.full((len(A), 1), 100.0)])  # noqa: E731
    Y = 2.0 * np.eye(4)[y.numpy()] - 1
    W = np.linalg.solve(pad(X).T @ pad(X) + 3.0 * np.eye(41), pad(X).T @ Y)
    assert np.array_equal(pred.numpy(), (pad(Xt) @ W).argmax(1))


def test_shot_sampling_is_per_class_and_seeded():
    labels = np.array([0] * 10 + [1] * 10 + [2] * 3)
    idx = sample_shots(labels, 3, shots=5, seed=0)
    assert np.bincount(labels[idx]).tolist() == [5, 5, 3]  # a class with fewer gives all it has
    assert len(set(idx.tolist())) == len(idx)
    assert np.array_equal(idx, sample_shots(labels, 3, 5, seed=0))
    assert not np.array_equal(idx, sample_shots(labels, 3, 5, seed=1))
    # which shot counts that makes hold fewer of a class than their name says, and the fewest
    assert short_classes(labels, 3, [1, 3, 5, 10]) == {5: (3, 2), 10: (3, 2)}
    assert short_classes(labels, 4, [1]) == {1: (0, 3)}  # a class with no example at all


def test_logistic_probe_equals_scikit_learn():
    """The linear probe's objective (mean cross-entropy + l2/2 ||W||^2 on standardised features,
    bias unpenalised) is scikit-learn's multinomial LogisticRegression with C = 1 / (l2 n): the same
    class probabilities on held-out points, the same accuracy, on classes that overlap."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    Xall, yall = _clusters(80, classes=5, dim=16, seed=3, spread=4.0)
    Xtr, ytr, Xte, yte = Xall[::2], yall[::2], Xall[1::2], yall[1::2]
    l2 = 1e-2
    ours = fit_logistic(Xtr, ytr, 5, l2=l2)
    scaler = StandardScaler().fit(Xtr.double().numpy())
    ref = LogisticRegression(C=1.0 / (l2 * len(ytr)), tol=1e-10, max_iter=5000).fit(
        scaler.transform(Xtr.double().numpy()), ytr.numpy())
    theirs = ref.predict_proba(scaler.transform(Xte.double().numpy()))
    mine = torch.softmax(ours.logits(Xte).double(), 1).numpy()
    assert np.abs(mine - theirs).max() < 2e-4  # measured 4e-5 (float32 weights kept by the probe)
    sk_acc = float((theirs.argmax(1) == yte.numpy()).mean())
    assert 0.4 < sk_acc < 0.99 and abs(ours.accuracy(Xte, yte) - sk_acc) <= 0.005  # overlapping: not trivial


def test_logistic_probe_separates_clusters_and_l2_shrinks_weights():
    Xall, yall = _clusters(60, classes=4, seed=2, spread=2.0)
    Xtr, ytr, Xte, yte = Xall[::2], yall[::2], Xall[1::2], yall[1::2]
    weak, strong = fit_logistic(Xtr, ytr, 4, l2=1e-4), fit_logistic(Xtr, ytr, 4, l2=1.0)
    assert weak.accuracy(Xte, yte) > 0.95  # chance: 0.25
    assert strong.weight.norm() < 0.5 * weak.weight.norm()


# ---------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def colour_task(tmp_path_factory):
    root = write_imagefolder(tmp_path_factory.mktemp("colours") / "colours", n_train=12, n_test=8)
    return imagefolder(str(root), minival_fraction=0.25, seed=0)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A fixed (randomly initialised) ViT-Tiny at 32 px, exported the way vit-export writes it."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    return save_safetensors(tiny_model(32), path, exported_metadata(
        {"name": "vit_tiny_patch16_224", "img_size": 32, "global_pool": "token"}, step=5, grid=(2, 2)))


def _run(ckpt, task, *overrides):
    cfg = load_config(None, ["eval.workers=0", "eval.batch_size=16", *overrides])
    return evaluate_checkpoint(cfg, load_pretrained(ckpt), [task], [], log=lambda m: None)


@pytest.mark.parametrize("protocol", ["linear", "fewshot", "knn"])
def test_frozen_feature_protocols_end_to_end(tiny_ckpt, colour_task, protocol):
    doc = _run(tiny_ckpt, colour_task, f"eval.protocol={protocol}", "eval.fewshot_shots=[1,5,10]",
               "eval.knn_k=[1,5,20]")
    r = doc["tasks"]["colours"]
    assert r["accuracy"] >= 0.75, r  # chance 0.25
    assert doc["step"] == 5 and doc["img_size"] == 32 and r["num_test"] == 32
    if protocol == "fewshot":
        assert set(r["details"]["shots"]) == {"1", "5", "10"} and r["details"]["headline_shots"] == 10
        assert len(r["details"]["shots"]["5"]["per_seed"]) == 3
    if protocol == "knn":  # 48 training images: 20-NN is the headline, every k reported with its top-5
        assert set(r["details"]["k"]) == {"1", "5", "20"} and r["details"]["headline_k"] == 20
        assert r["accuracy"] == r["details"]["k"]["20"]["top1"] <= r["details"]["k"]["20"]["top5"]


def _manifest_labels(folder) -> list[int]:
    """A shard folder's labels in manifest order (shard by shard, sample by sample), read with tarfile."""
    import json
    import tarfile

    labels = []
    for shard in json.loads((folder / "manifest.json").read_text())["shards"]:
        with tarfile.open(folder / shard["name"]) as tar:
            labels += [int(tar.extractfile(m).read()) for m in tar if m.name.endswith(".cls")]
    return labels


def test_shard_features_and_fewshot_do_not_depend_on_the_workers(tiny_ckpt, tmp_path):
    """A shard split read by two workers, whose contiguous parts the DataLoader interleaves, gives
    the features and labels one worker gives, row by row in manifest order, and so the same few-shot
    draws and scores (``eval.workers`` defaults to 2)."""
    from data_pipeline.shards.writer import write_demo_shards
    from pretrain.config import AugmentConfig, DataConfig
    from pretrain.transfer.data import make_view
    from pretrain.transfer.protocols.features import FeatureCache
    from pretrain.transfer.suites import demo

    for split, n in (("transfer-train", 45), ("transfer-test", 30)):  # 45: uneven over shards, workers, batches
        write_demo_shards(tmp_path / split, split, n=n, shard_size=16)
    task = demo(0.0, 0, str(tmp_path), DataConfig())
    view = make_view(task, 32, AugmentConfig())
    model = build_backbone(load_pretrained(tiny_ckpt), img_size=32)
    got = {w: FeatureCache(model, batch_size=8, pool="token", device=torch.device("cpu"), workers=w)
           .get(task.trainval, view) for w in (0, 2)}
    assert got[0][1].tolist() == _manifest_labels(tmp_path / "transfer-train")
    assert torch.equal(got[2][1], got[0][1])
    torch.testing.assert_close(got[2][0], got[0][0])
    shots = [_run(tiny_ckpt, task, "eval.protocol=fewshot", "eval.fewshot_shots=[1,3]", f"eval.workers={w}")
             ["tasks"]["demo"]["details"]["shots"] for w in (0, 2)]
    assert shots[0] == shots[1]


def test_probes_asking_for_more_than_the_train_split_holds_say_so(tiny_ckpt, colour_task):
    """50-shot of classes with 12 training images, and 500-NN of 48 training images: the numbers
    are what there is (big_vision's sampling; every image a neighbour), and the log, the result's
    details and its table say how many that was."""
    from pretrain.transfer.results import markdown

    for protocol, asked in (("fewshot", "eval.fewshot_shots=[5,50]"), ("knn", "eval.knn_k=[5,500]")):
        lines: list[str] = []
        cfg = load_config(None, ["eval.workers=0", "eval.batch_size=16", f"eval.protocol={protocol}", asked])
        doc = evaluate_checkpoint(cfg, load_pretrained(tiny_ckpt), [colour_task], [], log=lines.append)
        d = doc["tasks"]["colours"]["details"]
        table = markdown(doc)
        assert doc["world_size"] == 1 and doc["device_hours"] == doc["seconds"] / 3600  # one process's
        assert table.endswith(f"Evaluated in {doc['device_hours']:.3g} device-hours (1 device x "
                              f"{doc['seconds'] / 60:.3g} min)."), table
        if protocol == "fewshot":
            assert d["shots"]["50"]["fewest_of_a_class"] == 12 and "fewest_of_a_class" not in d["shots"]["5"]
            assert "colours fewshot: 50-shot asks for more examples than class 0 has (12)" in "\n".join(lines)
            assert "/ 50-shot " in table and " (a class had 12) |" in table
            # a sweep fits train (trainval less its minival) once per l2, then trainval: each line once
            lines.clear()
            cfg = load_config(None, ["eval.workers=0", "eval.batch_size=16", "eval.protocol=fewshot", asked,
                                     "eval.sweep=true", "eval.sweep_fewshot_l2=[1.0,1024.0]"])
            evaluate_checkpoint(cfg, load_pretrained(tiny_ckpt), [colour_task], [], log=lines.append)
            said = [x for x in lines if "50-shot asks for more examples" in x]
            assert len(said) == 2 and "(12)" in said[1] and "(12)" not in said[0], said
        else:
            assert d["k"]["500"]["neighbours"] == 48 and "neighbours" not in d["k"]["5"]
            assert "colours knn: k=500 asks for more neighbours than the 48 training images" in "\n".join(lines)
            assert " (48 exist) |" in table


def test_finetune_end_to_end_at_a_higher_resolution(tiny_ckpt, colour_task):
    """32 px checkpoint (2x2 grid) fine-tuned at 48 px (3x3): position embeddings resized, a new
    zero head, SGD + cosine; learns the task. The sweep's one learning rate (not eval.lr) is what
    ran, and what the results' recipe records."""
    pre = load_pretrained(tiny_ckpt)
    model = build_backbone(pre, img_size=48, num_classes=4, finetune=True)
    assert model.pos_embed.shape == (1, 10, 192)
    assert torch.equal(model.pos_embed, resize_pos_embed(pre.state_dict["pos_embed"], (3, 3), (2, 2)))
    assert torch.equal(model.blocks[0].attn.qkv.weight, pre.state_dict["blocks.0.attn.qkv.weight"])
    assert model.head.weight.abs().sum() == 0 and model.head.out_features == 4
    doc = _run(tiny_ckpt, colour_task, "eval.protocol=finetune", "eval.img_size=48", "eval.steps=30",
               "eval.warmup_steps=5", "eval.lr=0.03", "eval.sweep=true", "eval.sweep_lr=[0.01]")
    r = doc["tasks"]["colours"]
    assert doc["img_size"] == 48 and r["details"]["img_size"] == 48 and r["setting"] == {"lr": 0.01}
    assert r["details"]["recipe"]["lr"] == 0.01, r["details"]["recipe"]
    assert r["accuracy"] >= 0.75 and r["details"]["final_loss"] < 0.5, r


FT_STEPS, FT_WARMUP, FT_LR = 4, 2, 0.03


def test_finetune_steps_equal_plain_pytorch_from_the_recipe(tiny_ckpt, colour_task):
    """One process: fine-tune steps of ours against the recipe written in plain PyTorch
    (``reference_utils.finetune_reference``: timm's model with the file's backbone and a zero head,
    torch's SGD, clip_grad_norm_ and LambdaLR) on the same batches: those of the split's stream
    (augmentation off, so they are a function of the seed alone). fp32: reduction order only."""
    from reference_utils import finetune_reference, update_error
    from safetensors.torch import load_file

    from pretrain.transfer.evaluate import make_protocol

    cfg = load_config(None, ["eval.protocol=finetune", f"eval.steps={FT_STEPS}", f"eval.warmup_steps={FT_WARMUP}",
                             f"eval.lr={FT_LR}", "eval.batch_size=8", "eval.workers=0", "eval.train_augment=false"])
    protocol = make_protocol(cfg, load_pretrained(tiny_ckpt), 32, torch.device("cpu"), Dist(), lambda m: None)
    runner, _ = protocol.train(colour_task, colour_task.trainval, {"lr": FT_LR})

    batches = colour_task.trainval.batches(protocol.view_of(colour_task), batch_size=8, train=True, seed=cfg.eval.seed)
    clip = protocol.recipe.grad_clip  # the paper recipe's: 1
    before, ref, norms = finetune_reference(load_file(str(tiny_ckpt)), "vit_tiny_patch16_224", 32, 4, batches,
                                            steps=FT_STEPS, lr=FT_LR, warmup=FT_WARMUP, clip=clip)
    assert clip == 1.0 and max(norms) > clip, norms  # the clip changes a step: it is tested too
    error, _ = update_error(before, dict(runner.model.named_parameters()), ref)
    assert error <= 1e-5, error
    print(f"fine-tune, one process, {FT_STEPS} steps: relative error {error:.2g}, gradient norms {norms}")


DEIT_LR, DEIT_MIN_LR, DEIT_EMA = 1e-3, 1e-4, 0.999


def test_deit_finetune_steps_equal_plain_pytorch_with_timm_layer_decay(tiny_ckpt, colour_task):
    """``--recipe deit`` (AdamW, weight decay 0.05, layer decay 0.65 for 12 blocks, label smoothing
    0.1, cosine to a floor, EMA) against ``reference_utils.deit_finetune_reference``: timm's model,
    timm's ``param_groups_layer_decay``, torch's AdamW and LambdaLR, timm's
    ``LabelSmoothingCrossEntropy`` and ``ModelEmaV3``, on the same batches. Mixing and drop path
    are off here (their draws are another library's RNG); the mixed targets are held to timm's in
    ``test_mixed_targets_equal_timm_mixup``."""
    from reference_utils import deit_finetune_reference, update_error
    from safetensors.torch import load_file

    from pretrain.transfer.evaluate import make_protocol

    cfg = load_config(None, ["eval.protocol=finetune", "eval.recipe=deit", f"eval.steps={FT_STEPS}",
                             f"eval.warmup_steps={FT_WARMUP}", f"eval.lr={DEIT_LR}", f"eval.min_lr={DEIT_MIN_LR}",
                             f"eval.ema_decay={DEIT_EMA}", "eval.mixup_alpha=0", "eval.cutmix_alpha=0",
                             "eval.drop_path_rate=0", "eval.batch_size=8", "eval.workers=0",
                             "eval.train_augment=false"])
    protocol = make_protocol(cfg, load_pretrained(tiny_ckpt), 32, torch.device("cpu"), Dist(), lambda m: None)
    r = protocol.recipe
    assert (r.optimizer, r.weight_decay, r.layer_decay, r.label_smoothing, r.grad_clip) == \
        ("adamw", 0.05, 0.65, 0.1, 0.0)
    runner, _ = protocol.train(colour_task, colour_task.trainval, {"lr": DEIT_LR})

    batches = colour_task.trainval.batches(protocol.view_of(colour_task), batch_size=8, train=True, seed=cfg.eval.seed)
    before, ref, ref_ema = deit_finetune_reference(
        load_file(str(tiny_ckpt)), "vit_tiny_patch16_224", 32, 4, batches, steps=FT_STEPS, lr=DEIT_LR,
        warmup=FT_WARMUP, min_lr=DEIT_MIN_LR, weight_decay=0.05, layer_decay=0.65, smoothing=0.1, ema_decay=DEIT_EMA)
    names = [n for n, _ in runner.model.named_parameters()]
    error, _ = update_error(before, dict(runner.model.named_parameters()), ref)
    ema_error, _ = update_error(before, dict(zip(names, runner.ema.state())), ref_ema)
    assert error <= 1e-4 and ema_error <= 1e-4, (error, ema_error)
    print(f"deit fine-tune, one process, {FT_STEPS} steps: relative error {error:.2g}, EMA {ema_error:.2g}")


def test_mixed_targets_equal_timm_mixup():
    """Mixup / CutMix with label smoothing: for the lambda a batch drew (read back from the mixed
    pixels: image i is constant i, and image 0 is mixed with image B-1), the targets equal timm's
    ``mixup_target``."""
    from timm.data.mixup import mixup_target

    from pretrain.transfer.protocols.finetune import mixed_batch
    from pretrain.transfer.protocols.recipes import Recipe

    B, C = 6, 5
    x = torch.arange(B, dtype=torch.float32).view(B, 1, 1, 1).expand(B, 3, 16, 16).contiguous()
    y = torch.tensor([0, 1, 2, 3, 4, 1])
    for mixup, cutmix in ((0.8, 0.0), (0.0, 1.0), (0.8, 1.0)):
        recipe = Recipe("deit", "adamw", 1e-3, (), 0.0, 0.0, 0.05, 0.65, 0.1, mixup, cutmix, 0.1, 0.0, True)
        for seed in range(6):
            xm, t = mixed_batch(x, y, recipe, C, seed)
            lam = 1.0 - float(xm[0].mean()) / (B - 1)  # image 0 is zeros, image B-1 is B-1: its share is 1 - lam
            assert torch.allclose(t, mixup_target(y, C, lam, smoothing=0.1), atol=1e-6), (mixup, cutmix, seed)
    plain = Recipe("deit", "adamw", 1e-3, (), 0.0, 0.0, 0.05, 0.65, 0.1, 0.0, 0.0, 0.1, 0.0, True)
    assert mixed_batch(x, y, plain, C, 0)[1] is y  # no mixing: class indices, smoothed by the loss


def test_finetune_drops_the_pre_logits_layer_features_keep_it(tmp_path):
    """The ViT paper replaces the whole head (pre-logits too) when fine-tuning; frozen features
    use the pre-logits representation (big_vision)."""
    path = save_safetensors(tiny_model(32, representation_size=48), tmp_path / "rep.safetensors")
    pre = load_pretrained(path)  # no metadata: architecture read from the tensors
    assert pre.arch == {"name": "vit_tiny_patch16_224", "img_size": 32, "global_pool": "token",
                        "representation_size": 48, "reg_tokens": 0, "class_token": True, "pos_embed": "learned"}
    assert build_backbone(pre, img_size=32).num_features == 48
    ft = build_backbone(pre, img_size=32, num_classes=3, finetune=True)
    assert ft.num_features == 192 and isinstance(ft.pre_logits, torch.nn.Identity)


def test_feature_pooling_choices():
    """``model``: the model's own head input; ``token``: the normed [class] token; ``avg``: the
    mean of the patch tokens."""
    from pretrain.transfer.protocols.features import pooled

    m = tiny_model(32).eval()
    with torch.no_grad():
        tokens = m.forward_features(torch.randn(3, 3, 32, 32))
        assert torch.equal(pooled(m, tokens, "model"), m.forward_head(tokens, pre_logits=True))
        assert torch.equal(pooled(m, tokens, "token"), tokens[:, 0])
        assert torch.allclose(pooled(m, tokens, "avg"), tokens[:, 1:].mean(1))
        assert not torch.allclose(pooled(m, tokens, "avg"), tokens[:, 0])
