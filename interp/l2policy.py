"""An L2 evict_first policy on the interpreter kernel's 16-byte async copies (``Tiling.l2_first``).

The GEMV loops load their weights with ``tl.load(..., eviction_policy="evict_first")``, and the TTGIR
keeps the policy on the ``async_copy_global_to_local`` ops the pipeliner makes of them; Triton 3.6's
lowering of those ops drops it (the PTX's ``cp.async`` carry no cache policy), though it gives a load it
leaves unpipelined its policy (``createpolicy`` and ``ld.global...L2::cache_hint``). So every byte a layer
streams (~120 MB on the 1B, against an L2 of ~50 MB) enters the L2 at normal priority and evicts
whatever else is there: the kernel's code and constants (which an SM's instruction cache, ~128 KB
against a ~125 KB kernel, refetches), the activations one stage writes and a later one reads, the
counters.

A kernel built with ``L2_FIRST`` carries :data:`MARK` in its PTX (a comment in an inline asm at its
start), and the hook :func:`install` puts on Triton's compiler pipeline rewrites the PTX of such a
kernel only: each ``cp.async.cg.shared.global [dst], [src], 16{, src-size};`` (the 16-byte copies: the
weight streams and the attention's K/V prefix) becomes the same copy with ``.L2::cache_hint`` and an
``evict_first`` policy made by ``createpolicy`` (ptxas keeps the policy in a uniform register: one
memory descriptor for these copies, no register more). A cache hint changes no value a copy reads.
The marker is part of the kernel's source, so its Triton cache entries are its own; change
:data:`MARK` whenever the rewrite changes.
"""
from __future__ import annotations

import re

#: the comment a kernel whose PTX is to be rewritten carries (its inline asm, ``interp.codegen``)
MARK = "megatape:l2-evict-first:v1"

_COPY = re.compile(r"cp\.async\.cg\.shared\.global (\[[^\]]*\]), (\[[^\]]*\]), (0x10|16)((?:, %r\d+)?);")
#: the policy each rewritten copy makes (in a block of its own; ptxas keeps one in a uniform register)
POLICY = "createpolicy.fractional.L2::evict_first.b64 %mt_l2p, 1.0;"


def mark_asm() -> str:
    """The inline asm the marked kernel runs once (an identity on a 32-bit value) with :data:`MARK`."""
    return f"// {MARK}\n\tmov.b32 $0, $1;"


def rewrite_ptx(ptx: str) -> str:
    """``ptx`` with every 16-byte ``cp.async`` given an L2 evict_first policy, if it carries :data:`MARK`;
    else ``ptx`` itself. Raises ``ValueError`` if a marked kernel holds a 16-byte copy of a form this does
    not know (a Triton that emits another form would otherwise lose the policy silently)."""
    if MARK not in ptx:
        return ptx
    out, n = _COPY.subn(lambda m: "{ .reg .b64 %mt_l2p; " + POLICY + " cp.async.cg.shared.global.L2::cache_hint "
                        f"{m.group(1)}, {m.group(2)}, {m.group(3)}{m.group(4)}, %mt_l2p; }}", ptx)
    left = out.count("cp.async.cg.shared.global ")
    if left:
        line = next(ln for ln in out.splitlines() if "cp.async.cg.shared.global " in ln)
        raise ValueError(f"interp.l2policy: {left} 16-byte cp.async of a form it cannot rewrite, e.g. {line.strip()!r}")
    if n == 0:
        raise ValueError("interp.l2policy: a kernel marked for the L2 evict_first policy has no 16-byte cp.async")
    return out


def _hook(prev):
    def hook(*args):
        # (backend, stages, options, language, capability): Triton's NVIDIA and AMD backends
        if prev is not None:
            prev(*args)
        stages = args[1]
        if "ptx" in stages:
            make_ptx = stages["ptx"]
            stages["ptx"] = lambda src, metadata: rewrite_ptx(make_ptx(src, metadata))
    hook.megatape_l2policy = True
    return hook


def install() -> None:
    """Put :func:`rewrite_ptx` after the PTX stage of every compile in this process (once; a hook already
    there runs first). Kernels without :data:`MARK` compile as before."""
    from triton import knobs
    prev = knobs.runtime.add_stages_inspection_hook
    if not getattr(prev, "megatape_l2policy", False):
        knobs.runtime.add_stages_inspection_hook = _hook(prev)
