"""Wheels for a lent GPU machine: what ``make bench-gpu`` and ``pytest -m gpu`` need that the
machine's image lacks, built here (where the package registries are reachable) for its Python.

    make device-kit                              # -> device-kit/ (git-ignored), ~30 MB
    python benchmarks/device_kit.py --out device-kit --python-version 3.12

The lent machines (/work/.library/device/KINDS.md) have no network. Their image holds Python 3.12
with torch, torchvision, timm, numpy, Pillow and pytest, but not DeepSpeed, WebDataset or W&B.
The kit holds those three and everything they require (less what is large and surely in the
image: torch, torchvision, triton, numpy, Pillow, SciPy), at the versions installed in this
checkout's ``.venv`` (what CI tests), as wheels for that Python. ``requirements.txt`` pins the
three; pip keeps an image package whose version fits and takes the kit's otherwise. DeepSpeed is
published as a source archive only and builds here as a pure-Python wheel (its CUDA ops compile on
first use where needed; training here uses torch's fused AdamW and needs none).
``benchmarks/device_run.sh`` installs the kit on the machine and runs the suite or the GPU tests.

Not in the kit: NVIDIA packages (``nvidia-*``), DALI among them (``data.decode_device: dali``):
its wheel is 190 MiB and needs libnvcomp's 27 MiB, against the 64 MiB the device tool carries with
the tree in one call, so on a lent machine the suite's DALI row is skipped saying why and the DALI
``gpu`` tests fail saying why. Bringing it would take the wheels split into parts under 64 MiB, carried by
successive calls to one warm machine (an ignored path carried earlier stays there while the
machine is held) and joined before ``pip install``, or a machine image with DALI in it.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# what the suite and the gpu tests need beyond the image: training itself (DeepSpeed, W&B, which
# the tests' jobs run offline) and the loader (WebDataset); with their requirements, closed over
ROOTS = ("deepspeed", "webdataset", "wandb")
# in the image already and large (or CUDA builds of their own): never carried
IN_IMAGE = {"torch", "torchvision", "triton", "numpy", "pillow", "scipy"}
SOURCE_ONLY = {"deepspeed"}  # no wheel on the registry: built here, pure Python
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64", "any")


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def closure(roots, python_version: str) -> list[str]:
    """``name==version`` of ``roots`` and everything they require (markers evaluated for a Linux
    CPython ``python_version``; extras not taken), at the versions installed here, less IN_IMAGE."""
    from packaging.requirements import Requirement

    env = {"python_version": python_version, "python_full_version": python_version + ".0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix"}
    seen, todo = {}, [canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in IN_IMAGE or name.startswith(("nvidia-", "cuda-")):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"device_kit: {name} is not installed in {sys.prefix}; run `make install` first")
        seen[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(dict(env, extra="")):
                todo.append(canonical(req.name))
    return [f"{n}=={v}" for n, v in sorted(seen.items())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="device-kit", help="folder for the wheels and requirements.txt")
    ap.add_argument("--python-version", default="3.12", help="the lent machine's Python (KINDS.md)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pins = closure(ROOTS, args.python_version)
    pip = [sys.executable, "-m", "pip", "-q"]
    built = [p for p in pins if p.split("==")[0] in SOURCE_ONLY]
    binary = [p for p in pins if p not in built]
    subprocess.run(pip + ["wheel", "--no-deps", "-w", str(out)] + built, check=True)
    abi = "cp" + args.python_version.replace(".", "")
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(pip + ["download", "--no-deps", "--only-binary=:all:", "-d", str(out),
                          "--python-version", args.python_version, "--implementation", "cp", "--abi", abi,
                          "--abi", "abi3", "--abi", "none"] + platforms + binary, check=True)
    # the roots, pinned; pip takes the rest from the image where its version fits, else from here
    roots = {canonical(r) for r in ROOTS}
    (out / "requirements.txt").write_text("\n".join(p for p in pins if p.split("==")[0] in roots) + "\n")
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2 ** 20
    print(f"{out}: {len(wheels)} wheels for Python {args.python_version}, {size:.1f} MiB; "
          f"on the lent machine: bash benchmarks/device_run.sh suite|tests (carry {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
