"""The MLIR text of sharded programs: `syntax` (MLIR's tokens, types and attributes, and the few
words of the mesh/shard notation), `print` (the printer, in two spellings) and `parse` (the
parser, and the Program a printed module holds back: the printer's round-trip oracle)."""

from autoshard.errors import MlirError
from autoshard.mlir.parse import Module, parse_module
from autoshard.mlir.print import print_program
from autoshard.mlir.syntax import COLLECTIVES, DIALECTS, Dialect, MlirOp, SymbolRef, TensorType

__all__ = [
    "COLLECTIVES",
    "DIALECTS",
    "Dialect",
    "MlirError",
    "MlirOp",
    "Module",
    "SymbolRef",
    "TensorType",
    "parse_module",
    "print_program",
]
