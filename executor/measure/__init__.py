"""measure: what placement by cost needs to know about this machine and a program.

- op_profile.py: a program's op times, scaled to a compiled stage's step
  (fluidps.transpiler.cost_model.OpProfile);
- neighbors.py: busy processes an op profile is timed next to, as a pipeline's other
  stages run on the same host;
- calibrate.py: this machine's rates and a message's time over the transport
  (`fluidps calibrate`; fluidps.transpiler.cost_model.MachineModel).

May import: fluidps.errors, fluidps.ir, fluidps.ops, fluidps.transpiler.cost_model, fluidps.executor,
fluidps.executor.transport, fluidps.executor.launch
"""
