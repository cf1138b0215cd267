"""The megatape instruction set: one opcode per module, registered in dataflow order.

Importing this package registers every opcode; their numbers come from the order below and
nowhere else (the tape, the VM and the generated interpreter all read :data:`REGISTRY`).
"""
from .base import (BY_OPCODE, HEADER, LAYOUTS, MAX_OPERANDS, MAX_WAITS, NO_COUNTER, REGISTRY, WORDS, Cost,
                   Instruction, Layout, Region, Timing, kernel_constexprs, kernel_pointers, layout_from_json,
                   register, register_layout, scratch_buffers, state_buffers, unregister)
from .tiling import Tiling, cdiv, next_pow2
from .config import PRESETS, ModelConfig

# registration order = opcode numbers 1, 2, ...
from .qkv import QKV
from .attn_partial import AttnPartial
from .attn_reduce import AttnReduce
from .oproj import OProj
from .gate_up import GateUp
from .down import Down
from .residual import Residual
from .o_reduce import OReduce
from .embed import Embed
from .lm_head import LMHead
from .argmax import Argmax
from .sample import Sample
from .tp_push import TPPush
from .tp_reduce import TPReduce
from .tp_argmax import TPArgmaxPush, TPArgmax
from .sample_mass import SampleMass          # after the TP opcodes: the numbers before it stay as measured
# many rows per step (issue 50; opcodes/rows.py): after every one-row opcode, so their numbers stay
from .rows_embed import EmbedR
from .rows_qkv import QKVR
from .rows_attn import AttnR
from .rows_oproj import OProjR
from .rows_gate_up import GateUpR
from .rows_down import DownR
from .rows_residual import ResidualR
from .rows_lm_head import LMHeadR
from .rows_down_res import DownResR          # after LM_HEAD_R: the numbers before it stay as measured
from .rows import RowsLayout
from .decoder import DecoderLayout
from .tp import TPDecoderLayout, TPLayout

__all__ = ["BY_OPCODE", "HEADER", "LAYOUTS", "MAX_OPERANDS", "MAX_WAITS", "NO_COUNTER", "REGISTRY", "WORDS", "Cost",
           "Instruction", "Layout", "Region", "Tiling", "Timing", "cdiv", "kernel_constexprs", "kernel_pointers",
           "layout_from_json", "next_pow2", "register", "register_layout", "scratch_buffers", "state_buffers",
           "unregister", "PRESETS",
           "ModelConfig", "QKV", "AttnPartial", "AttnReduce", "OProj", "GateUp", "Down", "Residual", "OReduce",
           "Embed", "LMHead", "Argmax", "Sample", "TPPush", "TPReduce", "TPArgmaxPush", "TPArgmax", "SampleMass", "EmbedR", "QKVR", "AttnR", "OProjR", "GateUpR", "DownR", "ResidualR",
           "LMHeadR", "DownResR", "RowsLayout", "DecoderLayout",
           "TPLayout", "TPDecoderLayout"]
