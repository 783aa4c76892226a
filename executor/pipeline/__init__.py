"""Running a pipeline program: its stages' programs on a schedule, micro-batch by micro-batch.

- local.py: every stage in this process (Executor.run of a PipelineOptimizer's program),
  values crossing stages through an in-process channel

May import: fluidps.errors, fluidps.ir, fluidps.transpiler.pipeline, fluidps.transpiler.pipeline_plan
"""
