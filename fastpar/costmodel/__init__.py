"""The cost model: what a collective costs on a fabric, calibrated performance profiles, step simulation, and
bucket layouts chosen from predictions.

It imports nothing above it (no DDP, ZeRO or sharding engine, no benchmarks): ``fastpar.bench``,
``bucket_cap_mb="auto"`` and ``fastpar plan`` call it.
Modules: ``collective_costs`` (alpha-beta ring/tree formulas), ``fabrics`` (presets, topology-derived fabrics),
``perf_profile`` (the ``fastpar bench calibrate`` JSON), ``step_simulator`` (one training step),
``bucket_optimizer`` (bucket boundaries with the least predicted exposed communication); the memory planner:
``memory_planner`` (``plan``, ``fastpar plan``'s engine), ``model_spec`` and ``reference_transformer`` (the
model planned for), ``model_probe`` (measured activations and compute), ``strategy_memory`` and
``strategy_time`` (per-strategy bytes and step time), ``pipeline_split``, ``planner_comm``, ``plan_cli``.
"""
