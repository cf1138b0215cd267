"""Pictures, traces and measured-profile views of compiled tapes.

    from megatape.views import trace        # Chrome / Perfetto traces of planned or measured timelines
    from megatape.views import measured     # a measured timeline beside the plan (trace, Gantt, table)
    from megatape.views import profile      # per-opcode summary of a profiling launch
    from megatape.views import viz          # DAG pictures, zooms, graph files, the planned Gantt chart

``viz`` (and the Gantt chart of ``measured``) need matplotlib (``pip install 'megatape[plots]'``);
it is imported only when ``megatape.views.viz`` is, so traces and summaries work without it.
"""
from __future__ import annotations

import importlib

from . import measured, profile, trace
from .measured import compare, write_views
from .profile import format_summary, summarize, timeline_line
from .trace import critical_path, planned_records, to_trace_events, write_trace

__all__ = ["trace", "measured", "profile", "viz", "compare", "write_views", "format_summary", "summarize",
           "timeline_line", "critical_path", "planned_records", "to_trace_events", "write_trace", "render"]


def __getattr__(name):          # the matplotlib-backed parts, on first use
    if name == "viz":
        return importlib.import_module(".viz", __name__)
    if name == "render":
        return importlib.import_module(".viz", __name__).render
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
