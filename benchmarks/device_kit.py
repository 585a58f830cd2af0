"""Wheels for a GPU machine without network: what ``make bench-gpu`` and ``pytest -m gpu`` need that
the machine's image lacks, built where the package registries are reachable, for its Python.

    make device-kit                              # -> device-kit/ (git-ignored), ~55 MB
    python benchmarks/device_kit.py --out device-kit --python-version 3.12

The machine's image holds Python 3.12 with torch, torchvision, timm, numpy, Pillow and pytest, but
not DeepSpeed, WebDataset or W&B.
The kit holds those three and everything they require (less what is large and surely in the
image: torch, torchvision, triton, numpy, Pillow, SciPy), at the versions installed in this
checkout's ``.venv`` (what CI tests), as wheels for that Python. ``requirements.txt`` pins the
three; pip keeps an image package whose version fits and takes the kit's otherwise. DeepSpeed is
published as a source archive only and builds here as a pure-Python wheel (its CUDA ops compile on
first use where needed; training here uses torch's fused AdamW and needs none).
``benchmarks/device_run.sh`` installs the kit on the machine and runs the suite or the GPU tests.

The kit also carries NVIDIA nvImageCodec (``nvidia-nvimgcodec-cu13``, 25 MB, no requirements), so
that the loader workers there decode only each crop's window as they do wherever ``vitscale[decode]``
is installed (``data.worker_decoder: auto``), not with PIL's fallback.

The machine receives the working tree and named ignored folders with each command, 64 MiB at most,
and keeps what it received while it stays up. DALI (``data.decode_device: dali``) is 190 MiB with
its CUDA libraries (nvJPEG, nvJPEG2000, nvTIFF, nvCOMP: 270 MB in all), so it is a second kit, built
apart and sent in parts, one per command:

    make device-kit-nvidia        # -> device-kit-nvidia/part-01..NN + parts.sha256, each part < 60 MiB
    # then, per part, with device-kit-nvidia/part-0K and device-kit-nvidia/parts.sha256 sent along:
    #   bash benchmarks/device_run.sh carry
    # and last the suite or the tests with device-kit/ sent along as usual

``device_run.sh`` joins the parts (``--join``: each part's SHA-256 and the whole archive's checked)
and installs DALI before the suite or the tests when all are there; with any missing it says which,
and the suite's DALI row is skipped saying why. Without this kit the same row says so.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

# what the suite and the gpu tests need beyond the image: training itself (DeepSpeed, W&B, which
# the tests' jobs run offline) and the loader (WebDataset); with their requirements, closed over
ROOTS = ("deepspeed", "webdataset", "wandb")
# in the image already and large (or CUDA builds of their own): never carried
IN_IMAGE = {"torch", "torchvision", "triton", "numpy", "pillow", "scipy"}
SOURCE_ONLY = {"deepspeed"}  # no wheel on the registry: built here, pure Python
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_34_x86_64", "any")  # pip matches each exactly
# NVIDIA wheels the main kit carries (no requirements of their own), at the versions installed here
KIT_NVIDIA = ("nvidia-nvimgcodec-cu13",)
# the parts kit: DALI and what it requires, less IN_IMAGE (small ones are carried all the same: pip
# takes them only where the image's version does not fit DALI's bounds)
PARTS_ROOTS = ("nvidia-dali-cuda130",)
PART_BYTES = 58 * 2 ** 20  # a part and the tree (about 2 MiB) within the 64 MiB a command may send
SUMS = "parts.sha256"
ARCHIVE = "kit.tar"  # the name the sums give the joined parts


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


def wheel_project(path: Path) -> str:
    return canonical(path.name.split("-")[0])


def download(pins: list[str], out: Path, python_version: str, deps: bool = False) -> None:
    abi = "cp" + python_version.replace(".", "")
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "-q", "download"] + ([] if deps else ["--no-deps"])
                   + ["--only-binary=:all:", "-d", str(out), "--python-version", python_version, "--implementation",
                      "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"] + platforms + pins, check=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(archive: Path, out: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """``archive`` cut into ``out/part-01``.. of at most ``part_bytes``, and ``out/parts.sha256``
    naming each part's and the whole archive's SHA-256 (the archive last, as ``kit.tar``)."""
    parts, lines = [], []
    with open(archive, "rb") as f:
        for k, chunk in enumerate(iter(lambda: f.read(part_bytes), b""), 1):
            part = out / f"part-{k:02d}"
            part.write_bytes(chunk)
            parts.append(part)
            lines.append(f"{sha256(part)}  {part.name}")
    lines.append(f"{sha256(archive)}  {ARCHIVE}")
    (out / SUMS).write_text("\n".join(lines) + "\n")
    return parts


def join(folder: Path, to: Path) -> str | None:
    """The parts of ``folder`` (as its parts.sha256 lists them) joined and unpacked into ``to``; None
    when done, else one line saying what is missing or does not match (nothing is unpacked then)."""
    sums = folder / SUMS
    if not sums.is_file():
        return f"{sums}: missing (make device-kit-nvidia here, then carry the parts)"
    listed = [ln.split("  ", 1) for ln in sums.read_text().splitlines() if ln.strip()]
    (whole, _), parts = listed[-1], listed[:-1]
    missing = [name for _, name in parts if not (folder / name).is_file()]
    if missing:
        return f"{folder}: {len(missing)} of {len(parts)} parts not carried yet: {', '.join(missing)}"
    bad = [name for digest, name in parts if sha256(folder / name) != digest]
    if bad:
        return f"{folder}: SHA-256 differs from {SUMS} for {', '.join(bad)} (carry them again)"
    to.mkdir(parents=True, exist_ok=True)
    archive = to / ARCHIVE
    with open(archive, "wb") as f:
        for _, name in parts:
            f.write((folder / name).read_bytes())
    if sha256(archive) != whole:
        return f"{folder}: the joined parts' SHA-256 differs from {SUMS}'s {ARCHIVE} (parts from two builds?)"
    with tarfile.open(archive) as t:
        # the "data" filter (no absolute paths, links out of the folder or devices) where this Python
        # has extraction filters (3.11.4 on); before that the archive's checksum above is the guard
        t.extractall(to, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    archive.unlink()
    return None


def parts_kit(out: Path, python_version: str, part_bytes: int = PART_BYTES) -> list[Path]:
    """DALI and its requirements (less IN_IMAGE) as wheels with a requirements.txt, archived and
    split into parts of ``out``."""
    pins = [f"{n}=={metadata.version(n)}" for n in PARTS_ROOTS]
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    download(pins, wheels, python_version, deps=True)
    for w in wheels.glob("*.whl"):
        if wheel_project(w) in IN_IMAGE:
            w.unlink()
    (wheels / "requirements.txt").write_text("\n".join(pins) + "\n")
    archive = out / ARCHIVE
    with tarfile.open(archive, "w") as t:
        for f in sorted(wheels.iterdir()):
            t.add(f, arcname=f.name)
            f.unlink()
    wheels.rmdir()
    for old in out.glob("part-*"):
        old.unlink()
    parts = split(archive, out, part_bytes)
    archive.unlink()
    return parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="device-kit", help="folder for the wheels and requirements.txt")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    ap.add_argument("--nvidia", action="store_true", help="the DALI kit in parts instead (--out device-kit-nvidia)")
    ap.add_argument("--join", metavar="DIR", help="on the GPU machine: join DIR's parts and unpack them into --out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.join:
        why = join(Path(args.join), out)
        print(f"device_kit: {why}" if why else f"device_kit: {args.join} joined into {out}")
        return 3 if why else 0
    out.mkdir(parents=True, exist_ok=True)
    if args.nvidia:
        parts = parts_kit(out, args.python_version)
        size = sum(p.stat().st_size for p in parts) / 2 ** 20
        print(f"{out}: {len(parts)} parts, {size:.1f} MiB; carry one per call with {out}/{SUMS} "
              f"(command: bash benchmarks/device_run.sh carry)")
        return 0
    pins = closure(ROOTS, args.python_version)
    pip = [sys.executable, "-m", "pip", "-q"]
    built = [p for p in pins if p.split("==")[0] in SOURCE_ONLY]
    binary = [p for p in pins if p not in built]
    nvidia = [f"{n}=={metadata.version(n)}" for n in KIT_NVIDIA]
    subprocess.run(pip + ["wheel", "--no-deps", "-w", str(out)] + built, check=True)
    download(binary + nvidia, out, args.python_version)
    # the roots, pinned; pip takes the rest from the image where its version fits, else from here
    roots = {canonical(r) for r in ROOTS}
    (out / "requirements.txt").write_text("\n".join([p for p in pins if p.split("==")[0] in roots] + nvidia) + "\n")
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2 ** 20
    print(f"{out}: {len(wheels)} wheels for Python {args.python_version}, {size:.1f} MiB; "
          f"on the GPU machine: bash benchmarks/device_run.sh suite|tests (with {out} beside the tree)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
