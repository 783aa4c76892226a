"""The program IR: the Fluid ProgramDesc wire format and its Python objects.

The bottom layer: of fluidps it imports only fluidps.errors (the error types every
layer raises), never ops, transpiler or executor; op definitions reach it as data
(opschema.OpSchema), so verify and inference take the schemas they check against.
tests/unit/test_layering.py holds it to the declaration below.

May import: fluidps.errors
"""

from fluidps.ir.operator import Operator
from fluidps.ir.program import Block, Program
from fluidps.ir.types import AttrType, OpRole, VarType
from fluidps.ir.variable import Parameter, Variable

__all__ = ["AttrType", "Block", "OpRole", "Operator", "Parameter", "Program", "VarType", "Variable"]
