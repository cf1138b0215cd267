"""Is the 1B decode step bounded by the card's power? Clocks, power and throttle reasons while it runs.

    python3 -m bench.probes.power_probe [--seconds 8] [--pos 128]        (a GPU; nvidia-smi on PATH)

bench/NOTES.md v105 (session 22): a change that took 0.4-0.5 us a layer off the attention (the HBM idle)
did not shorten the step; the stages after it (gate/up, down: the HBM at full rate) took longer. One
explanation that no profile can show: the card at its power limit, so an idle HBM phase lends the
streaming phases their clocks. This probe runs, for ``--seconds`` each, (1) the 1B whole-model decoder
step after step at one position, (2) a bf16 device-to-device copy (the HBM at full rate), (3) nothing,
while ``nvidia-smi`` samples every 20 ms: power, its limit, SM and memory clocks, temperature and the
active clock-event (throttle) reasons. Prints one row per phase (medians; reasons as the union of
the samples' bits with their share) and the decoder's us a step in that window.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time

import torch

FIELDS = "timestamp,power.draw,power.limit,clocks.sm,clocks.mem,temperature.gpu,clocks_event_reasons.active"
#: nvidia-smi's clock-event reason bits (nvml.h: nvmlClocksEventReason*)
REASONS = {0x1: "gpu_idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


def parse_samples(text: str) -> list[tuple[float, ...]]:
    """nvidia-smi CSV rows (no header, no units) -> (t seconds, power W, limit W, sm MHz, mem MHz, temp C,
    reasons bitmask); rows it cannot read are skipped."""
    out = []
    for line in text.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) != 7:
            continue
        try:
            t = time.mktime(time.strptime(f[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + f[0].split(".")[1])
            out.append((t, float(f[1]), float(f[2]), float(f[3]), float(f[4]), float(f[5]), int(f[6], 16)))
        except (ValueError, IndexError):
            continue
    return out


def summarize(samples, t0: float, t1: float) -> dict:
    """Medians of the samples in [t0, t1] and each reason's share of them."""
    win = [s for s in samples if t0 <= s[0] <= t1]
    if not win:
        return {"n": 0}
    med = lambda i: statistics.median(s[i] for s in win)
    reasons = {}
    for bit, name in REASONS.items():
        k = sum(1 for s in win if s[6] & bit)
        if k:
            reasons[name] = k / len(win)
    return {"n": len(win), "power_W": med(1), "limit_W": med(2), "sm_MHz": med(3), "mem_MHz": med(4),
            "temp_C": med(5), "power_max_W": max(s[1] for s in win), "reasons": reasons}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.probes.power_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--preset", default="llama3.2-1b")
    a = ap.parse_args(argv)
    if not a.seconds > 0:
        raise SystemExit(f"--seconds must be > 0, got {a.seconds}")
    from interp import build_decoder, decode_step, teardown
    from opcodes import PRESETS
    from opcodes.reference import make_kv_cache
    from ..decoder_bench import make_decoder_weights
    cfg = PRESETS[a.preset]
    dev = torch.device("cuda")
    w = make_decoder_weights(cfg, 0, dev)
    kv = make_kv_cache(cfg, a.pos + 8, a.pos, device=dev)
    h = build_decoder(w, kv, cfg, a.pos + 8)
    tok = torch.tensor([1], dtype=torch.int32, device=dev)
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    fields = FIELDS
    if subprocess.run(["nvidia-smi", "--query-gpu=clocks_event_reasons.active", "--format=csv"],
                      capture_output=True).returncode:
        fields = FIELDS.replace("clocks_event_reasons", "clocks_throttle_reasons")     # older drivers' name
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "20",
                            "-i", str(torch.cuda.current_device())], stdout=log, stderr=subprocess.DEVNULL)
    phases = []
    try:
        time.sleep(1.0)
        for name in ("decoder", "copy", "idle"):
            torch.cuda.synchronize()
            t0 = time.time()
            n = 0
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record()
            while time.time() - t0 < a.seconds:
                for _ in range(64):
                    if name == "decoder":
                        decode_step(h, tok, a.pos)
                    elif name == "copy":
                        dst.copy_(src)
                n += 64 if name != "idle" else 0
                if name == "idle":
                    time.sleep(0.05)
                torch.cuda.synchronize()
            e1.record()
            torch.cuda.synchronize()
            t1 = time.time()
            us = e0.elapsed_time(e1) * 1e3 / n if n else 0.0
            phases.append((name, t0 + 0.5, t1, us))
        time.sleep(0.2)
    finally:
        smi.terminate()
        smi.wait()
        teardown(h)
    log.seek(0)
    samples = parse_samples(log.read())
    print(f"{torch.cuda.get_device_name()}: {a.preset} at pos {a.pos}, {a.seconds:.0f} s a phase, {len(samples)} samples")
    print("| phase | us a call | samples | power W (max) | limit W | SM MHz | mem MHz | temp C | clock-event reasons |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, t0, t1, us in phases:
        s = summarize(samples, t0, t1)
        if not s["n"]:
            print(f"| {name} | {us:.1f} | 0 | - | - | - | - | - | - |")
            continue
        rs = ", ".join(f"{k} {v:.0%}" for k, v in s["reasons"].items()) or "none"
        print(f"| {name} | {us:.1f} | {s['n']} | {s['power_W']:.0f} ({s['power_max_W']:.0f}) | {s['limit_W']:.0f} | "
              f"{s['sm_MHz']:.0f} | {s['mem_MHz']:.0f} | {s['temp_C']:.0f} | {rs} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
