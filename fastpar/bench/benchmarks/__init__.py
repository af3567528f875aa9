"""One module per ``fastpar bench`` benchmark (``collectives`` serves the five collectives), each on the shared
harness, table and launcher of ``fastpar.bench``, with the modules they share: ``collective_cases`` (buffers,
calls, exact results), ``training_step`` (models, one-step check, table columns of ``ddp`` and ``zero``) and
``image_loading`` (what ``data`` and its object-store mode ``data_remote`` charge and check). No benchmark
imports another benchmark's module.
"""
