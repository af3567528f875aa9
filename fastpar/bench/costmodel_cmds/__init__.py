"""The cost-model commands of ``fastpar bench``: ``calibrate`` measures a profile on the live process group
(``calibration``: the measurements, ``grad_timeline``: when each gradient is ready), ``simulate`` predicts
step time and scaling from a profile or a ``published`` case, and ``validation`` checks both against what
was measured. They call ``fastpar.costmodel``; the benchmarks next door (``fastpar.bench.benchmarks``) do not.
"""
