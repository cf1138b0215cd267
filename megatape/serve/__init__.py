"""``megatape serve``: an OpenAI-compatible HTTP server with continuous batching.

* :mod:`megatape.serve.engine`: the scheduler (:class:`Engine`) over a :class:`Backend` of B sequence
  slots (:class:`RefBackend`, the torch reference; :class:`KernelBackend`, the batched megakernel);
* :mod:`megatape.serve.app`: the FastAPI app (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``), imported only when serving (it needs the ``serve`` extra: fastapi,
  uvicorn).
"""
from .engine import (Backend, Draining, Engine, Event, KernelBackend, QueueFull, RefBackend, Request, Sampling,
                     batched_kernel_available, sample_token)

__all__ = ["Backend", "Draining", "Engine", "Event", "KernelBackend", "QueueFull", "RefBackend", "Request",
           "Sampling", "batched_kernel_available", "sample_token"]
