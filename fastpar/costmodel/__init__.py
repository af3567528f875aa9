"""The cost model: what a collective costs on a fabric, calibrated performance profiles, step simulation, and
bucket layouts chosen from predictions.

It imports nothing above it (no DDP, no benchmarks): ``fastpar.bench`` and ``bucket_cap_mb="auto"`` call it.
Modules: ``collective_costs`` (alpha-beta ring/tree formulas), ``fabrics`` (presets, topology-derived fabrics),
``perf_profile`` (the ``fastpar bench calibrate`` JSON), ``step_simulator`` (one training step),
``bucket_optimizer`` (bucket boundaries with the least predicted exposed communication).
"""
