"""Host runtime of the interpreter kernel: the spec's ``build_layer / layer_step / teardown``.

``build_layer`` (untimed) validates the inputs, compiles and verifies the tape for this device,
binds the buffers (the per-layer offset table: the kernel reads the caller's weights and KV cache
where they are, no repack; the opcodes' scratch, state and tables), generates and compiles the
kernel for the tape's opcodes and makes the launcher.
``layer_step`` is exactly one launch of one persistent kernel with one program per SM.

The call count and the next position live on the device, in a control block the kernel advances
itself (``codegen.CTL_*``): call ``e`` (1, 2, ...) waits for ``target * e``, and a launch is the
same every time, so steps can be captured in a CUDA graph and replayed. Counters are reset only
by the kernel after ``epoch_limit`` calls (int32 range) or by the host after a failed call.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from opcodes import Layout, ModelConfig, Tiling, kernel_constexprs, kernel_pointers, state_buffers
from schedule import CostModel, Tape, compile_model, verify

from .common import (TORCH_DTYPES, arg_error, check_open, check_pos, check_spin_limit, check_step_args, describe,
                     device_sms, epoch_limit, kernel_args, parse_cfg, validate_inputs)
from .codegen import (CTL_POS, CTL_WORDS, FAIL_PAST_TARGET, FAIL_POSITION, FAIL_TIME, PROF_WORDS, STATUS_WORDS,
                      SWITCHES, load_kernel)

DEFAULT_SPIN_LIMIT = 1 << 20
INTERPRETER_SPIN_LIMIT = 2


class MegakernelError(RuntimeError):
    """The kernel gave up waiting (a broken tape or a missing producer), found a counter past its
    target or a device position outside the cache; ``stuck`` lists the SMs that stopped on a wait
    with (sm, slot, instruction, counter, target, seen, call, code: ``codegen.FAIL_*``)."""

    def __init__(self, msg: str, stuck: list):
        super().__init__(msg)
        self.stuck = stuck


@dataclass
class LayerHandle:
    """What ``build_layer`` returns: everything a step needs, prepared once."""

    cfg: ModelConfig
    lay: Layout
    tape: Tape
    device: torch.device
    num_sms: int
    spin_limit: int
    sync_check: bool
    bindings: Bindings = field(repr=False, default=None)   # the kernel's buffers (bind_buffers)
    weights: dict = field(repr=False, default=None)
    kv_cache: list = field(repr=False, default=None)
    predicted_makespan_s: float | None = None
    # set by make_control: the tape on the device, counters, status block, profile buffer
    tape_dev: torch.Tensor = field(repr=False, default=None)
    qoff_dev: torch.Tensor = field(repr=False, default=None)
    counters: torch.Tensor = field(repr=False, default=None)
    status: torch.Tensor = field(repr=False, default=None)
    prof: torch.Tensor = field(repr=False, default=None)
    ctl: torch.Tensor = field(repr=False, default=None)       # the control block (codegen.CTL_*)
    status_flag: object = field(default=None, repr=False)   # the pinned status word, when it is host memory
    # set by compile_kernel
    kernel: object = field(default=None, repr=False)        # the generated JITFunction
    constexprs: dict = field(default_factory=dict, repr=False)
    launch_opts: dict = field(default_factory=dict, repr=False)
    launcher: object = field(default=None, repr=False)      # FastLauncher (GPU) or None (JIT launch)
    resources: dict = field(default_factory=dict)           # registers, spills, shared memory (GPU)
    # per call
    last_pos: int = -1            # the position of the last host-driven call (-1: taken on the device)
    next_out: torch.Tensor = field(default=None, repr=False)   # the next call's output, never handed out yet
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    in_capture: bool = False      # inside a Stepping whose stream captures a CUDA graph
    wait_ns: int | None = None    # tensor parallel: every wait's time bound (interp.tp), for messages

    @property
    def scratch(self) -> dict:
        return self.bindings.scratch

    @property
    def state(self) -> dict:
        return self.bindings.state

    @property
    def buffers(self) -> dict:
        """Build-time kernel pointer name -> tensor."""
        return self.bindings.pointers

    @property
    def status_host(self) -> bool:
        return self.status_flag is not None

    def check(self, sync: bool = True) -> None:
        """Raise :class:`MegakernelError` if the last launch stopped on a wait (syncs first)."""
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.status_flag is not None:
            if not self.status_flag.value:       # one pinned word: any SM gave up
                return
            if not sync:                         # the rows are complete once the kernel has ended
                torch.cuda.synchronize(self.device)
            st = self.status[1:]
        else:
            st = self.status[1:].cpu()
            if not st[:, 0].numpy().any():
                return
        rows = st[st[:, 0] != 0].tolist()
        stuck = []
        for code, sm, slot, op, ctr, tgt, seen, ep in rows:
            if code == FAIL_POSITION:
                continue
            cname = self.tape.counters[ctr] if 0 <= ctr < len(self.tape.counters) else str(ctr)
            # slot -1: the pool's ticket (interp.codegen's _ticket), taken before any instruction
            desc = self.tape.describe(slot) if slot >= 0 else f"sm {sm} taking a pool ticket"
            stuck.append((sm, slot, desc, f"{ctr} ({cname})", tgt, seen, ep, code))
        bad_pos = [r for r in rows if r[0] == FAIL_POSITION]
        written = self._kv_written(stuck[0][6]) if stuck else "was not written (the call ran nothing)"
        reset_counters(self)            # the next launch starts clean
        if bad_pos:
            raise MegakernelError(
                f"megakernel stopped: the position taken from the device ({bad_pos[0][6]}) is outside the KV "
                f"cache [0, max_seq_len={self.lay.max_seq}); nothing ran. Counters were reset; the next launch "
                "starts clean (at position 0 unless one is given).", [])
        past = [x for x in stuck if x[7] == FAIL_PAST_TARGET]
        if past:
            lines = [f"  {desc}: counter {c} was already at {s}, past this call's target {t} (call {ep})"
                     for (_, _, desc, c, t, s, ep, _) in past[:8]]
            raise MegakernelError(
                f"megakernel stopped: {len(past)} SM(s) found a counter past its target: another launch of this "
                "handle ran at the same time (two streams or threads), or the call count is out of step with "
                "the counters:\n" + "\n".join(lines) +
                f"\nKV cache position {self.last_pos}: {written}.\n"
                "Counters were reset; the next launch starts clean. The output of this call is invalid.",
                stuck)
        lines = [f"  {desc}: waited on counter {c} for {t} (call {ep}: {t // max(1, ep)} producers per call), "
                 f"saw {s}" for (_, _, desc, c, t, s, ep, _) in stuck[:8]]
        n_time = sum(x[7] == FAIL_TIME for x in stuck)
        bound = f"{self.wait_ns / 1e9:g} s (the time bound)" if self.wait_ns else "the time bound"
        limit = (f"{self.spin_limit} polls" if not n_time else bound if n_time == len(stuck)
                 else f"{self.spin_limit} polls or {bound}")
        raise MegakernelError(
            f"megakernel stopped: {len(stuck)} SM(s) gave up waiting after {limit} "
            f"(a producer never signalled):\n" + "\n".join(lines) +
            ("\n  ..." if len(stuck) > 8 else "") +
            f"\nKV cache position {self.last_pos}: {written}.\n"
            "Counters were reset; the next launch starts clean. The output of this call is invalid.", stuck)

    def _kv_written(self, epoch: int) -> str:
        """Whether this call's K/V row at ``pos`` was written, from the qkv counters."""
        cnt = self.counters.cpu().tolist()
        targets: dict[int, int] = {}
        for c in self.tape.words[:, 5].tolist():
            if c >= 0:
                targets[c] = targets.get(c, 0) + 1
        done, partial, untouched = [], [], []
        for c, name in enumerate(self.tape.counters):
            if name.startswith("kv["):
                need = targets.get(c, 0) * epoch
                if cnt[c] >= need:
                    done.append(name)
                else:
                    partial.append(name)
                    if cnt[c] <= targets.get(c, 0) * (epoch - 1):
                        untouched.append(name)
        if not partial:
            return "was written (every K/V tile of this call finished)"
        if len(untouched) == len(partial) and not done:
            # a tile that starts runs to its signal (SMs stop only at waits): no signal, no write
            return "was not written (no K/V tile of this call ran)"
        if not done:
            return "was not completely written (no KV group finished; some rows may be partly written)"
        return (f"was written for {len(done)} KV group(s) and NOT completely for {len(partial)} "
                f"({', '.join(partial[:4])}{', ...' if len(partial) > 4 else ''})")


def _resolve_tape(cfg: ModelConfig, max_seq_len: int, device: torch.device, dev_sms: int, num_sms, tiling,
                  policy, tape, verify_tape, cost_model, seed, lowering, pool_us, elide_waits=True):
    """The verified tape for this device (compiled here unless given) and its predicted makespan."""
    if num_sms is None:
        num_sms = dev_sms
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or not 1 <= num_sms <= dev_sms:
        raise arg_error(ValueError, "num_sms", f"an int in [1, {dev_sms}] (SMs that can be co-resident on {device})",
                        num_sms)
    if tape is None:
        comp = compile_model(cfg, num_sms, max_seq=max_seq_len, tiling=tiling, policy=policy, model=cost_model,
                             seed=seed, sequential=(device.type == "cpu"), lowering=lowering, pool_us=pool_us,
                             decoder=False, elide_waits=elide_waits)   # build_layer / build_model: the layers alone, whatever cfg.vocab
        return comp.tape, (comp.expected_makespan() if device.type == "cuda" else comp.sched.makespan)
    if tape.lay.cfg.to_dict() != cfg.to_dict() or tape.lay.max_seq != max_seq_len:
        raise ValueError("tape: compiled for a different cfg or max_seq_len than the one given")
    if tape.num_sms > dev_sms:
        raise arg_error(ValueError, "tape", f"at most {dev_sms} SM queues", tape.num_sms)
    if verify_tape:
        verify(tape, sequential=(device.type == "cpu"))
    return tape, None


def peer_pointers(classes) -> list[str]:
    """The kernel pointers into the peer rank's memory of a tape of these opcodes (tensor
    parallel): the peer's counters and the peer's buffers of ``PEER_POINTERS``; [] for one GPU."""
    from opcodes.base import TP_POINTERS, signals_peer
    if not signals_peer(classes):
        return []
    return ["peer_cnt_ptr"] + [p for cls in classes for p in cls.PEER_POINTERS if p not in TP_POINTERS]


@dataclass
class Bindings:
    """The device memory a tape's kernel reads and writes, by kernel pointer name."""

    pointers: dict            # build-time pointer name -> tensor (the kernel's address table, in order)
    scratch: dict             # scratch buffer name -> tensor (written every call)
    state: dict               # state buffer name -> tensor (persists across calls)
    table: torch.Tensor       # int64 addresses of ``pointers``, what the kernel's ``ptab_ptr`` points at


def bind_buffers(tape: Tape, weights: dict, kv_cache: list, device: torch.device,
                 share: Bindings | None = None) -> Bindings:
    """Allocate the scratch, state and tables of the tape's opcodes and bind every build-time
    pointer their device functions take to its tensor: the layout's per-layer tensors (layer 0's,
    with the offset table ``wtab`` for the others) and whole-model tensors, the opcodes' scratch,
    state and tables. The caller's weights and KV cache are used in place (no repack).
    ``share``: the bindings of another tape of the same model whose kernel never runs at the same
    time as this one's (a decoder's second tape): its state buffers are this tape's too (the token,
    the tokens made, the sampling parameters), and so is each scratch buffer of the same name, size
    and dtype (the logits among them), so either tape's launch reads what the other's left."""
    lay, classes = tape.lay, tape.classes()
    cfg = lay.cfg
    layers = weights["layers"]
    per_layer = {}
    for key, ptr in lay.TENSORS:
        if key in ("kc", "vc"):
            per_layer[ptr] = (key, [pair[0 if key == "kc" else 1] for pair in kv_cache])
        else:
            per_layer[ptr] = (key, [lw[key] for lw in layers])
    tab = torch.zeros(cfg.layers, len(lay.TENSORS), dtype=torch.int64)
    for j, (ptr, (key, ts)) in enumerate(per_layer.items()):
        base = ts[0].data_ptr()
        for l, t in enumerate(ts):
            delta = t.data_ptr() - base
            if delta % 16:
                raise ValueError(f"{key} of layer {l}: not 16-byte aligned relative to layer 0")
            tab[l, j] = delta // t.element_size()
    avail = {"wtab_ptr": tab.to(device)}
    avail.update({ptr: ts[0] for ptr, (_, ts) in per_layer.items()})
    avail.update({ptr: weights[key] for key, ptr in lay.MODEL_TENSORS if key in weights})
    virtual = {n for cls in classes for n in cls.VIRTUAL}
    def _own(shared: dict, name: str, shape, dt, make):
        t = shared.get(name)
        if t is not None and t.numel() == math.prod(shape) and t.dtype == TORCH_DTYPES[dt]:
            return t
        return make(math.prod(shape), dtype=TORCH_DTYPES[dt], device=device)

    scratch = {name: _own(share.scratch if share else {}, name, shape, dt, torch.empty)
               for name, (shape, dt) in tape.buffers().items() if name not in virtual}
    state = {name: _own(share.state if share else {}, name, shape, dt, torch.zeros)
             for name, (shape, dt) in state_buffers(lay, classes).items()}
    if share is not None:
        apart = sorted(n for n in state if n in share.state and state[n] is not share.state[n])
        if apart:
            raise ValueError(f"share: state buffers {apart} differ in size or dtype between the two tapes")
    avail.update({f"{n}_ptr": t for n, t in {**scratch, **state}.items()})
    for cls in classes:
        avail.update(cls.tables(lay, device))
    # the kernel holds every opcode's branch: a pointer no opcode on this tape takes is never
    # dereferenced, and points at a small zeroed buffer
    on_tape = {a for cls in classes for a in cls.ARGS}
    unused = torch.zeros(16, dtype=torch.int32, device=device)
    peer_names = peer_pointers(classes)
    if peer_names:
        # tensor parallel: which of this rank's counters the peer signals (the same indices its own
        # SIGNALS_PEER instructions signal on the peer: both ranks run the same program); the
        # pointers into the peer's memory are bound by interp.tp.wire_peer, until then a placeholder
        from schedule.tape import decode
        sig = torch.zeros(max(1, tape.n_counters), dtype=torch.int32)
        for d in decode(tape):
            if type(d.ins).SIGNALS_PEER and d.signal >= 0:
                sig[d.signal] = 1
        avail["peer_sig_ptr"] = sig.to(device)
        # every wait's time bound in ns (interp.tp sets it; until then 10 minutes)
        avail["tp_wait_ptr"] = torch.full((2,), 600 * 10**9, dtype=torch.int64, device=device)
        types = kernel_pointers(lay, classes)
        avail.update({n: torch.zeros(16, dtype=TORCH_DTYPES[types[n]], device=device) for n in peer_names})
        on_tape |= set(peer_names)
    model = {ptr: key for key, ptr in lay.MODEL_TENSORS}
    pointers = {}
    for name, dt in kernel_pointers(lay, classes).items():
        t = avail.get(name)
        if t is None:
            if name in on_tape and name in model:
                raise arg_error(ValueError, "weights", f"key {model[name]!r} (the tape's opcodes read it)",
                                f"keys {sorted(weights)}")
            if name in on_tape:
                raise ValueError(f"{name}: an opcode on the tape takes it, but no buffer of this layout provides it")
            pointers[name] = unused
            continue
        if t.dtype != TORCH_DTYPES[dt]:
            raise TypeError(f"{name}: the kernel reads {dt}, the tensor bound to it is {t.dtype}")
        if t.data_ptr() % 16:
            raise ValueError(f"{name}: buffer not 16-byte aligned")
        pointers[name] = t
    table = torch.tensor([t.data_ptr() for t in pointers.values()] or [0], dtype=torch.int64, device=device)
    return Bindings(pointers, scratch, state, table)


def build_layer(weights, kv_cache, cfg, max_seq_len, **options) -> LayerHandle:
    """Prepare one decoder layer (or ``cfg['layers']`` layers) for ``layer_step``. Untimed.

    weights  : {"layers": [ {in_norm, post_norm, q, k, v, o, gate, up, down} ]} bf16, row-major
    kv_cache : [(k, v)] per layer, each (1, n_kv, max_seq_len, hd) bf16, updated in place
    cfg      : the spec's cfg dict (layers, d, ffn, n_q, n_kv, hd, eps, theta, wdtype)
    Options: ``num_sms`` (default: all SMs of the device), ``tiling``, ``policy`` ('cost',
    'round-robin', 'random'), ``tape`` (a precompiled tape; ``verify_tape=False`` skips the verifier,
    for tests of broken tapes), ``spin_limit`` (polls before a wait gives up), ``sync_check``
    (check the kernel's status after every step; default on the CPU), ``profile``, ``cooperative``
    (launch as a cooperative grid, which the driver refuses unless every program is co-resident;
    without it, residency rests on the grid being one 1-CTA-per-SM program per SM),
    ``pool_us`` (the plan's last microseconds go to a pool the SMs take from at run time, see
    ``schedule.assign.with_pool``; 0: static queues only; None: ``schedule.compile.DEFAULT_POOL_US``),
    ``lowering`` (Layout -> Program, see ``schedule.program.lower``; whole-model decoders use it),
    ``elide_waits`` (``compile_model``'s: drop the waits an earlier instruction of the SM made),
    ``share_buffers`` (a handle of the same model and cache whose state and same-sized scratch this
    one uses, :func:`bind_buffers`' ``share``: the two must never run at the same time).

    The steps: validate the inputs, compile and verify the tape, bind the buffers
    (:func:`bind_buffers`), generate and compile the kernel for the tape's opcodes, make the
    launcher (a direct driver launch on a GPU, Triton's JIT launch under the interpreter).
    """
    cfg = parse_cfg(cfg)
    return build_validated(weights, kv_cache, cfg, validate_inputs(weights, kv_cache, cfg, max_seq_len), max_seq_len,
                           **options)


def build_validated(weights, kv_cache, cfg: ModelConfig, device: torch.device, max_seq_len: int, *,
                    num_sms: int | None = None, tiling: Tiling | None = None, policy: str = "cost",
                    tape: Tape | None = None, verify_tape: bool = True, spin_limit: int | None = None,
                    sync_check: bool | None = None, cost_model: CostModel | None = None, profile: bool = False,
                    seed: int = 0, cooperative: bool = True, lowering=None, pool_us: float | None = None,
                    elide_waits: bool = True, share_buffers: LayerHandle | None = None) -> LayerHandle:
    """:func:`build_layer` after its checks of the inputs: ``cfg`` parsed (``common.parse_cfg``), the
    weights and cache checked on ``device`` (``common.validate_inputs``), for a caller that has done
    both (the decoder, whose two tapes share the inputs). The options are :func:`build_layer`'s."""
    if tape is not None and peer_pointers(tape.classes()):
        raise ValueError("tape: a tensor-parallel rank's tape (it signals its peer); build both ranks with "
                         "interp.tp.build_tp_layers / build_tp_decoder")
    if spin_limit is None:
        # NOTE: the Triton interpreter runs programs one after another, so a counter cannot move
        # while a program waits on it: one poll decides. On a GPU, 2^20 polls are 0.2-1 s.
        spin_limit = INTERPRETER_SPIN_LIMIT if device.type == "cpu" else DEFAULT_SPIN_LIMIT
    check_spin_limit(spin_limit)
    tape, predicted = _resolve_tape(cfg, max_seq_len, device, device_sms(device), num_sms, tiling, policy, tape,
                                    verify_tape, cost_model, seed, lowering, pool_us, elide_waits)
    if share_buffers is not None:
        if not isinstance(share_buffers, LayerHandle) or share_buffers.closed:
            raise arg_error(TypeError, "share_buffers", "an open handle of build_layer", describe(share_buffers))
        if share_buffers.kv_cache is not kv_cache or share_buffers.device != device:
            raise ValueError("share_buffers: a handle of another KV cache or device (a second tape shares the "
                             "first's cache)")
    b = bind_buffers(tape, weights, kv_cache, device, share_buffers.bindings if share_buffers is not None else None)
    h = LayerHandle(cfg=cfg, lay=tape.lay, tape=tape, device=device, num_sms=tape.num_sms, spin_limit=spin_limit,
                    sync_check=(device.type == "cpu") if sync_check is None else bool(sync_check),
                    predicted_makespan_s=predicted, weights=weights, kv_cache=kv_cache, bindings=b)
    make_control(h, profile)
    compile_kernel(h, profile, cooperative)
    if h.status.device.type == "cpu" and device.type == "cuda":
        import ctypes
        h.status_flag = ctypes.c_int32.from_address(h.status.data_ptr())
    return h


def make_control(h: "LayerHandle", profile: bool) -> None:
    """The tape on the device, its counters, the status block and the profile buffer."""
    tape, device = h.tape, h.device
    h.counters = torch.zeros(max(1, tape.n_counters), dtype=torch.int32, device=device)
    h.status = None
    if device.type == "cuda":
        try:   # pinned host memory: the host can see a failed wait without a device sync
            h.status = torch.zeros(h.num_sms + 1, STATUS_WORDS, dtype=torch.int32, pin_memory=True)
        except RuntimeError:
            pass
    if h.status is None:
        h.status = torch.zeros(h.num_sms + 1, STATUS_WORDS, dtype=torch.int32, device=device)
    # profiled: a row a tape slot, then a row an SM (kernel entry, queue done, exit)
    h.prof = torch.zeros((len(tape) + h.num_sms) * PROF_WORDS if profile else 1, dtype=torch.int64, device=device)
    h.tape_dev = tape.words.reshape(-1).to(device, copy=True)      # never an alias of the host tape
    # counters reach target x calls: after epoch_limit calls the kernel zeroes them (int32 range)
    extra = torch.tensor([tape.pool_counter, max(1, tape.n_counters), epoch_limit([tape])], dtype=torch.int32)
    h.qoff_dev = torch.cat([tape.offsets, extra]).to(device)
    h.ctl = torch.zeros(CTL_WORDS, dtype=torch.int32, device=device)


def reset_counters(h) -> None:
    """Zero a kernel handle's counters, status block and control block (the call count and the
    position): after a failed call, so that the next launch starts clean."""
    h.status.zero_()
    h.counters.zero_()
    h.ctl.zero_()


def make_kernel(lay: Layout, used, interp: bool, profile: bool = False):
    """The interpreter kernel (a JITFunction) for a tape of ``lay`` holding the opcodes ``used``,
    and its constexpr values: ``interp`` for the Triton interpreter, ``profile`` for the profiling
    build (tests/test_kernels_compile.py compiles what this returns for sm_90 without a GPU)."""
    cx = kernel_constexprs(lay, interp=interp, used=used)
    cx["PROFILE"] = profile
    return load_kernel(kernel_pointers(lay, used), [k for k in cx if k not in SWITCHES], used), cx


def compile_kernel(h: "LayerHandle", profile: bool, cooperative: bool) -> None:
    """Generate the interpreter kernel; on a GPU compile it now (build is untimed) and make the
    direct launcher."""
    lay, device = h.lay, h.device
    h.kernel, cx = make_kernel(lay, h.tape.classes(), interp=(device.type == "cpu"),
                               profile=bool(profile and device.type == "cuda"))
    h.constexprs = cx
    h.launch_opts = {"num_warps": lay.tiling.num_warps, "num_stages": 1}
    if device.type != "cuda":
        return
    h.launch_opts["launch_cooperative_grid"] = bool(cooperative)
    x0 = torch.zeros(1, h.cfg.d, dtype=torch.bfloat16, device=device)
    args, kw = kernel_args(h, x0, 0, x0)
    ck = h.kernel.warmup(*args, grid=(h.num_sms,), **kw)
    ck._init_handles()
    h.resources = {"n_regs": ck.n_regs, "n_spills": ck.n_spills, "shared": ck.metadata.shared}
    from .fastlaunch import FastLauncher
    try:
        h.launcher = FastLauncher(
            ck, h.num_sms,
            fixed=dict(tape_ptr=h.tape_dev, qoff_ptr=h.qoff_dev, cnt_ptr=h.counters, status_ptr=h.status,
                       prof_ptr=h.prof, ptab_ptr=h.bindings.table, ctl_ptr=h.ctl, spin_limit=h.spin_limit),
            dynamic=("pos_arg", "x_ptr", "out_ptr"), cooperative=bool(cooperative))
    except (OSError, NotImplementedError, ValueError, AttributeError) as e:
        # Triton's JIT launch below still works; it costs tens of microseconds of host time more
        h.resources["fast_launch"] = f"off: {e!r}"


def capturing(h: LayerHandle) -> bool:
    """Whether the current stream of the handle's device is capturing a CUDA graph."""
    return h.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class Stepping:
    """Holds a handle for one step (or a run of steps): a second thread stepping the same handle
    meanwhile gets a clear error, since its counters serve one launch at a time. Capturing steps in
    a CUDA graph works: the call count and the position live on the device (the control block),
    so a replayed launch waits for the right counter targets. Under capture the host-side checks
    that need a synchronisation are left to the next ordinary step after the replays
    (``h.in_capture`` tells the launches inside); a handle built with ``sync_check=True`` cannot be
    captured (it synchronises after every step)."""

    def __init__(self, h: LayerHandle):
        self.h = h

    def __enter__(self):
        h = self.h
        if not h.lock.acquire(blocking=False):
            raise RuntimeError("handle: stepped from two threads at once; a handle's counters serve one launch "
                               "at a time: use one handle per thread (or a lock around its steps)")
        cap = capturing(h)
        if cap and h.sync_check:
            h.lock.release()
            raise ValueError("handle: built with sync_check=True, which synchronises after every step and cannot "
                             "be captured in a CUDA graph; build it with sync_check=False")
        if h.status_host and not cap:
            try:
                h.check(sync=False)     # a failure of an earlier launch that has finished since
            except BaseException:
                h.lock.release()
                raise
        h.in_capture = cap
        return cap

    def __exit__(self, *exc):
        self.h.in_capture = False
        self.h.lock.release()
        return False


def set_position(h, pos: int) -> None:
    """Set the position the next ``pos=None`` step of ``h`` (a handle of ``build_layer`` /
    ``build_model``, or a ``DecoderHandle``) takes: a device write, ordered on the current stream
    (captured too, inside a CUDA graph). A decoder of two tapes: both."""
    dh = h
    h = getattr(h, "layer", h)
    if not isinstance(h, LayerHandle):
        raise arg_error(TypeError, "handle", "a handle of build_layer / build_model / build_decoder", describe(h))
    check_open(h)
    pos = check_pos(h, pos)
    for k in getattr(dh, "handles", (h,)):
        k.ctl[CTL_POS].fill_(pos)
    if hasattr(dh, "next_pos"):       # a decoder: its pos=None steps go on from here, on slot 0
        dh.next_pos = pos
        dh.held_slot = 0


def launch(h: LayerHandle, x: torch.Tensor, pos: int, out: torch.Tensor) -> None:
    """One launch of the interpreter kernel (no checks); ``pos`` -1: the position on the device.
    The call count and the next position live in the control block, which the kernel advances:
    the launch is the same every time, so it can be captured in a CUDA graph and replayed."""
    if h.launcher is not None:
        h.launcher(torch._C._cuda_getCurrentRawStream(h.device.index), pos_arg=pos,
                   x_ptr=x.data_ptr(), out_ptr=out.data_ptr())
    else:
        args, kw = kernel_args(h, x, pos, out)
        h.kernel[(h.num_sms,)](*args, **kw)


def layer_step(h: LayerHandle, x: torch.Tensor, pos) -> torch.Tensor:
    """Run the layer(s) on one hidden state; append this position's K/V into the cache.

    x   : (1, d) bf16, the incoming residual stream (read, never written)
    pos : int, the absolute position being written; None: the position the device holds (the
          last call's + 1, or :func:`set_position`'s), which is what a captured CUDA graph of
          several steps uses
    returns a fresh (1, d) bf16 tensor: the residual stream after the layer(s) (under CUDA-graph
    capture: the graph's output tensor, which every replay rewrites)
    """
    pos = check_step_args(h, x, pos)
    with Stepping(h) as capture:
        # NOTE: the output was allocated after the previous launch, while the GPU ran: the
        # allocation (~4 us of host time on the lent VM) stays off the launch path. Each call still
        # returns a tensor of its own that no earlier or later call writes.
        out = h.next_out if (h.next_out is not None and not capture) else \
            torch.empty(1, h.cfg.d, dtype=torch.bfloat16, device=h.device)
        if not capture:
            h.next_out = None
        h.last_pos = pos
        launch(h, x, pos, out)
        if not capture:
            h.next_out = torch.empty_like(out)
        if h.sync_check:
            h.check(sync=True)
    return out


def teardown(h: LayerHandle) -> None:
    """Release the handle's device buffers (idempotent)."""
    if h.closed:
        return
    if h.device.type == "cuda":
        torch.cuda.synchronize(h.device)
    h.closed = True
    h.next_out = None
    h.bindings = Bindings({}, {}, {}, None)
    h.weights = None
    h.kv_cache = None


def profile_records(h: LayerHandle):
    """Per tape slot: (wait start, exec start, end, sm) in ns, from the last profiled launch."""
    return _prof_rows(h)[:len(h.tape)]


def profile_sm_records(h: LayerHandle):
    """Per SM: (kernel entry, its queue and pool done, exit after the end-of-call bookkeeping, sm) in ns,
    from the last profiled launch."""
    return _prof_rows(h)[len(h.tape):]


def _prof_rows(h: LayerHandle):
    if not h.constexprs.get("PROFILE"):
        raise ValueError("handle: build_layer(..., profile=True) on a GPU is needed for profile records")
    torch.cuda.synchronize(h.device)
    return h.prof.view(-1, PROF_WORDS).cpu()
