"""Torch-native state dicts: DTensor placements as intervals, save/load of a job's own state dict
(DTensor, FSDP2, TP, PP) in place, and torchtitan's CheckpointManager on them.

Modules: ``agree``, ``dtensor``, ``state_dict``, ``titan_checkpoint``.
Nothing is imported here: import the module (``from tenplex.native.agree import ...``),
so that importing one module of the tier does not load the others.
"""
