"""Python's cyclic garbage collector around a program's start-up.

Importing torch, dynamo, inductor and DeepSpeed makes about a million long-lived objects and almost
no garbage, and every full pass of the collector walks all of them (a quarter of a second each on
a 2-core CPU machine): about 0.6 CPU-s of a rank's start-up is the collector running while it
imports, and each of DeepSpeed's explicit ``gc.collect()`` calls (ZeRO-3's ``defragment``, the bf16
optimizer's memory lines) costs as much again. A program module therefore turns the collector off
before its imports (``gc.disable()`` under ``if __name__ == "__main__"``) and calls
:func:`after_imports` first thing in ``main``: what the imports made is frozen (``gc.freeze``, as
CPython's documentation advises before forking), so that later passes, DeepSpeed's included, walk
only the newer objects and forked data workers do not write to those pages, and the collector is
on again for the run. Imported as a library (a test, the ``vit-train`` console script) the
collector stays on during the imports; freezing then is the same.
"""
from __future__ import annotations

import gc


def after_imports() -> None:
    """Freeze what exists and turn the collector (back) on."""
    gc.freeze()
    gc.enable()
