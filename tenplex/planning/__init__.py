"""Decisions (pure, no I/O): the reshard planner, rank assignment, layout choice, memory estimates,
topology, transfer schedules and the elastic-run simulator.

Modules: ``assignment``, ``choose``, ``layouts``, ``memory``, ``planner``, ``reshard``, ``schedule``, ``simulate``, ``topology``.
Nothing is imported here: import the module (``from tenplex.planning.assignment import ...``),
so that importing one module of the tier does not load the others.
"""
