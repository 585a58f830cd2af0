"""The resolution schedule at run time (``train.resolution_schedule``, phases in
``pretrain/config/phases.py``): the engine's micro batch per phase.

The loop asks for each step's phase before the step (:class:`PhaseSwitch`). At the first step of a
phase (and at the first step a process takes, which may be inside a phase after a resume) the engine
takes the phase's micro batch with the global batch kept (``ds_compat.set_micro_batch``). The
batches follow the same phases by themselves (``data_pipeline.loading.step_batches``): both are
functions of the step, so every rank switches at the same boundary without a word between them.
"""
from __future__ import annotations

from typing import Callable

from pretrain.config.phases import Phase, phase_at
from pretrain.distributed import ds_compat


class PhaseSwitch:
    """Called at the start of every step with the step's number (from 1); returns its phase."""

    def __init__(self, phases: list[Phase], engine, say: Callable[[str], None] = lambda msg: None):
        self.phases, self.engine, self.say = phases, engine, say
        self.current = None

    def __call__(self, step: int) -> Phase:
        phase = phase_at(self.phases, step)
        if phase != self.current:
            gas = ds_compat.set_micro_batch(self.engine, phase.micro_batch)
            if len(self.phases) > 1:
                i = self.phases.index(phase) + 1
                self.say(f"step {step}: {phase.img_size} px, micro batch {phase.micro_batch} x {gas} accumulation "
                         f"step(s) (resolution phase {i} of {len(self.phases)}: steps {phase.first}-{phase.last})")
            self.current = phase
        return phase
