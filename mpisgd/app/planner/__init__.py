"""The planner behind ``python -m mpisgd.plan`` (mpisgd.app.plan is its command line), one job a module:

* :mod:`~mpisgd.app.planner.workload`: one rank's step and the run's rate rule, from a profile run's
  metrics file or described by numbers;
* :mod:`~mpisgd.app.planner.topology`: the cluster (ranks per node, links and their presets with sources,
  the library's all-reduce algorithms and what they cost);
* :mod:`~mpisgd.app.planner.model`: the step at k ranks (buckets, overlap, the sharded step), statistical
  efficiency, goodput, the recommendation and the constraint that chose it;
* :mod:`~mpisgd.app.planner.report`: the table, the JSON, the plot.
"""
