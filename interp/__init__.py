"""The persistent interpreter kernel and its host runtime.

    from interp import build_layer, layer_step, teardown
    from interp import build_model, model_step                  # N layers, one launch per step
    from interp import build_decoder, decode_step, generate     # whole model: token -> logits / next token
    from interp import generate_stream                          # ... the tokens as they come (sampling, EOS)
    from interp import prefill                                  # a prompt in chunks of many rows a launch;
                                                                # decode_step(h, tokens (B,), pos (B,)): a batch
    from interp.textgen import Checkpoint, generate_text        # text in, text out (megatape generate)
    from interp import load_hf_llama                            # a Hugging Face Llama checkpoint directory
    from interp.tp import build_tp_layers, build_tp_decoder     # tensor parallel, 2 ranks: a CPU loopback, or one
                                                                # rank per process on GPUs (tp_group=)
"""
from .interpreter import speed_up_device_calls
from .runtime import MegakernelError, build_layer, layer_step
from .decoder import DecoderHandle, build_decoder, decode_step, generate, generate_stream
from .hf import load_hf_llama
from .rows import prefill
from .model import build_model, model_step, teardown

__all__ = ["MegakernelError", "build_layer", "layer_step", "teardown", "build_model", "model_step",
           "DecoderHandle", "build_decoder", "decode_step", "generate", "generate_stream", "load_hf_llama",
           "prefill"]

speed_up_device_calls()          # under TRITON_INTERPRET=1 only (interp/interpreter.py)
