"""The application: what ``python -m mpisgd.train|evaluate|plan|plot`` run.

Set-up (``run``), the loop (``trainer``), what rank 0 prints (``report``), the files a run writes
(checkpoint directories, metrics, TensorBoard, the configuration's copies), signals, the planner and
the plots. The library below it (``mpisgd.nn``, ``mpisgd.optim``, ``mpisgd.comm``,
``mpisgd.parallel``) knows nothing of this package.
"""
