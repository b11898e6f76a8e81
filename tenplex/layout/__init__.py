"""Where every byte lives (pure, no I/O): parallel configs, meshes, state layouts, parallelizable
tensor collections, interval overlap, model presets.

Modules: ``config``, ``mesh``, ``models``, ``overlap``, ``ptc``, ``state_layout``.
Nothing is imported here: import the module (``from tenplex.layout.config import ...``),
so that importing one module of the tier does not load the others.
"""
