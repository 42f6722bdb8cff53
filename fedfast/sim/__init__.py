"""The parts of :class:`fedfast.Simulation` besides the round itself (``fedfast/engine.py``), each a mixin the
Simulation class combines: :mod:`.training` (a chunk's local steps), :mod:`.services` (the engine interface a method uses, :class:`fedfast.methods.Engine`),
:mod:`.sizing` (probing the model, the executor, the chunk size and memory errors), :mod:`.evaluation` (test and
validation metrics, forgetting) and :mod:`.snapshots` (checkpoint, restore, the trained model's weights);
:mod:`.memory` holds the memory helpers they share. :mod:`.plan` (the round plan) and :mod:`.budget` (the memory
budget) are pure functions the engine calls, each tested alone."""
