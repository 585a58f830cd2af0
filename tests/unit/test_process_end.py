"""A command's end (``process_group_ends``): its process group destroyed on every way out, and a
collective that waits on a peer does not hold the exit."""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from pretrain.distributed.process import free_port, process_group_ends


@pytest.mark.parametrize("exit_with, code", [(SystemExit(2), 2), (ValueError("boom"), None)])
def test_the_process_group_is_destroyed_and_the_exit_kept(tmp_path, exit_with, code):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)  # a finished collective: its work is what a late free would touch
        with pytest.raises(type(exit_with)) as e, process_group_ends():
            raise exit_with
        assert e.value is exit_with and getattr(e.value, "code", None) == code
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


RANK = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from pretrain.distributed.process import process_group_ends
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.barrier()
    if rank == 1:  # a peer that never joins the next collective (until it is ended)
        print("waiting", flush=True)
        time.sleep(600)
    with process_group_ends(bound_s=1.0):
        dist.all_reduce(torch.ones(4), async_op=True)  # in flight: destroying the group waits for it
        raise ValueError("rank 0 fails with a collective in flight")
""")


def test_a_collective_waiting_on_a_peer_does_not_hold_the_exit(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(free_port())
    cmd = [sys.executable, str(script)]
    peer = subprocess.Popen([*cmd, "1", port], stdout=subprocess.PIPE, text=True)
    try:
        r = subprocess.run([*cmd, "0", port], capture_output=True, text=True, timeout=120)
        assert peer.stdout.readline() == "waiting\n"
        assert peer.poll() is None  # the peer still holds the collective open: rank 0 left anyway
        assert r.returncode == 1, r.stderr[-2000:]
        assert "ValueError: rank 0 fails with a collective in flight" in r.stderr  # said before leaving
        assert "terminate called" not in r.stderr
    finally:
        peer.kill()
        peer.wait()
