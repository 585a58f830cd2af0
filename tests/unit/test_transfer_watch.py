"""``vit-transfer --watch``'s loop (``pretrain.transfer.watch.watch``) on a run directory whose
checkpoints appear while it evaluates, on a clock of its own: no model, no sleeping."""
from pretrain.transfer.watch import watch


def _complete(ckpt_dir, step: int) -> None:
    d = ckpt_dir / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "COMPLETE").write_text("")


def test_an_evaluation_longer_than_the_idle_timeout_does_not_end_the_watch(tmp_path):
    """The idle timeout counts time without a new checkpoint, not time spent evaluating: a
    checkpoint written during a 100 s evaluation is evaluated next, though the timeout is 30 s."""
    ckpt = tmp_path / "checkpoints"
    _complete(ckpt, 10)
    now = [0.0]

    def evaluate(step, path):
        now[0] += 100.0  # the evaluation of step 10 takes 100 s; the training job saves step 20 meanwhile
        if step == 10:
            _complete(ckpt, 20)

    def sleep(s):
        now[0] += s

    done = watch(tmp_path, evaluate, poll_s=5.0, idle_timeout_s=30.0, log=lambda msg: None, sleep=sleep,
                 clock=lambda: now[0])
    assert done == [10, 20]
    # step 10's evaluation, one poll, step 20's, then the 30 s without a new checkpoint
    assert now[0] == 100.0 + 5.0 + 100.0 + 30.0


def test_idle_timeout_zero_evaluates_what_is_there_then_stops(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for step in (1, 2):
        _complete(ckpt, step)
    done = watch(tmp_path, lambda step, path: None, poll_s=5.0, idle_timeout_s=0.0, log=lambda msg: None,
                 sleep=lambda s: None, clock=lambda: 0.0)
    assert done == [1, 2]
