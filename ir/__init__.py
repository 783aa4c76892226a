"""The program IR: the Fluid ProgramDesc wire format and its Python objects.

May import: fluidps.errors
"""

from fluidps.ir.operator import Operator
from fluidps.ir.program import Block, Program
from fluidps.ir.types import AttrType, OpRole, VarType
from fluidps.ir.variable import Parameter, Variable

__all__ = ["AttrType", "Block", "OpRole", "Operator", "Parameter", "Program", "VarType", "Variable"]
