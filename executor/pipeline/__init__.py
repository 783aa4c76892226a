"""Running a pipeline program: its stages' programs on a schedule, micro-batch by micro-batch.

- stage.py: one stage's actions on its schedule, and its update once a step
- local.py: every stage in this process (Executor.run of a PipelineOptimizer's program),
  values crossing stages through an in-process channel
- channel.py: a stage process's channel to the others (STAGE_SEND messages)

May import: fluidps.errors, fluidps.ir, fluidps.transpiler.pipeline, fluidps.transpiler.pipeline_plan,
fluidps.executor.transport
"""
