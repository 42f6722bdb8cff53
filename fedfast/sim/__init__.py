"""The parts a :class:`fedfast.Simulation` (``fedfast/engine.py``) wires together, each built and tested alone:
:mod:`.runtime` (the model as the engine runs it: layout, verified executor, forwards, predictions, the head),
:mod:`.plan` (the round plan: cohort, weights, data order, batch tables, minibatches, from the data's placement),
:mod:`.sizing` (the memory budget: a client's bytes, the chunk, per-client state, out-of-memory messages; its
arithmetic in :mod:`.budget`), :mod:`.trainer` (a chunk's local training and its buffers), :mod:`.evaluation`
(test and validation metrics, a round's record, forgetting), :mod:`.state` (all that crosses rounds, and its
checkpoint) and :mod:`.facade` (the engine as a method sees it); :mod:`.memory` holds the memory helpers they
share."""
