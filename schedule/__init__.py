"""DAG, SM assignment, counters and the tape: everything megatape does before the GPU runs."""
from .assign import CostModel, Schedule, list_schedule, random_schedule, round_robin, simulate
from .compile import Compiled, CompiledTP, compile_model
from .dag import build_dag, critical_path_seconds
from .program import Program, lower, make_layout
from .tape import Decoded, Tape, decode, encode
from .verify import Report, TapeError, verify, verify_system, verify_tp

__all__ = ["CostModel", "Schedule", "list_schedule", "random_schedule", "round_robin", "simulate", "Compiled",
           "CompiledTP", "compile_model", "build_dag", "critical_path_seconds", "Program", "lower", "make_layout", "Decoded", "Tape", "decode", "encode", "Report",
           "TapeError", "verify", "verify_system", "verify_tp"]
