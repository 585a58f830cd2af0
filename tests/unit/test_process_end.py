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


ENDS = textwrap.dedent("""
    import atexit, ctypes, sys, threading, time
    from pathlib import Path
    from pretrain.distributed.process import program
    out = Path(sys.argv[1])
    libc = ctypes.CDLL(None)
    # C-level teardown that aborts, registered as a C++ static's destructor is (__cxa_atexit), as
    # one that finds a library's worker thread still joinable does
    libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
    log = open(out / "open.txt", "w")  # never closed: finalization would flush it

    def main():
        def late():
            time.sleep(0.3)
            (out / "thread.txt").write_text("done")
        threading.Thread(target=late).start()  # non-daemon: the process waits for it
        atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
        log.write("buffered")
        print("said", flush=False)
        raise SystemExit(int(sys.argv[2]))

    if sys.argv[3] == "program":
        program(main)
    main()
""")


@pytest.mark.parametrize("code", [0, 3])
def test_a_command_ends_with_its_code_past_a_teardown_that_aborts(tmp_path, code):
    """``program``: the command's threads finished, its exit handlers run, its open files and
    stdout flushed, and its code kept; the C-level teardown after that (here an abort registered
    with libc's atexit, as a C++ static's destructor is) never runs. Without it, the same process
    dies of that abort (SIGABRT) after doing all of the rest."""
    script = tmp_path / "ends.py"
    script.write_text(ENDS)

    def run(how):
        for name in ("thread.txt", "atexit.txt", "open.txt"):
            (tmp_path / name).unlink(missing_ok=True)
        return subprocess.run([sys.executable, str(script), str(tmp_path), str(code), how], capture_output=True,
                              text=True, timeout=60)

    for how, want in (("program", code), ("plain", -6)):
        r = run(how)
        assert r.returncode == want, (how, r.returncode, r.stderr[-2000:])
        assert r.stdout == "said\n"
        assert (tmp_path / "thread.txt").read_text() == "done" and (tmp_path / "atexit.txt").read_text() == "ran"
        assert (tmp_path / "open.txt").read_text() == "buffered"
