"""Model configuration: the typed form of the spec's ``cfg`` dict.

A :class:`ModelConfig` is the shape of the model (what the weights are); a
:class:`~opcodes.tiling.Tiling` is how megatape cuts it into instructions (what the kernel runs).
Both are validated on construction so that a bad value is reported where it was given, not deep
inside the kernel.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

WDTYPES = ("bf16",)

#: RoPE variants ``opcodes.reference.rope_tables`` builds: plain RoPE, and Llama 3.1 / 3.2's frequency rescaling
#: (transformers' ``rope_type: "llama3"``).
ROPE_TYPES = ("default", "llama3")
#: the llama3 scaling fields, all required with ``rope_type="llama3"`` and all None (absent) otherwise
LLAMA3_ROPE_FIELDS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_pos")


def _check_pos_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"cfg[{name!r}] must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"cfg[{name!r}] must be positive, got {value}")


def _keys(names) -> str:
    return ", ".join(f"cfg[{k!r}]" for k in names)


@dataclass(frozen=True)
class ModelConfig:
    """One Llama-family decoder stack. Field names follow the spec's ``cfg`` dict."""

    layers: int
    d: int
    ffn: int
    n_q: int
    n_kv: int
    hd: int
    eps: float = 1e-5
    theta: float = 500000.0
    wdtype: str = "bf16"
    vocab: int = 0          # 0: no embedding / LM head (the spec's single-layer task)
    # RoPE scaling (Llama 3.1 / 3.2). "default": inv_freq = theta^(-2i/hd). "llama3": that inv_freq rescaled by
    # transformers' _compute_llama3_parameters with these four values (its factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings). Omitted from to_dict() when unset.
    rope_type: str = "default"
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_pos: int | None = None
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for k in ("layers", "d", "ffn", "n_q", "n_kv", "hd"):
            _check_pos_int(k, getattr(self, k))
        if isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab < 0:
            raise ValueError(f"cfg['vocab'] must be an int >= 0, got {self.vocab!r}")
        if self.n_q % self.n_kv:
            raise ValueError(f"cfg['n_q'] = {self.n_q} must be a multiple of cfg['n_kv'] = {self.n_kv} (GQA)")
        if self.hd % 2:
            raise ValueError(f"cfg['hd'] = {self.hd} must be even (RoPE rotates pairs of dims)")
        if self.hd & (self.hd - 1):
            raise ValueError(f"cfg['hd'] = {self.hd} must be a power of two (the attention tile is hd wide)")
        for k in ("eps", "theta"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"cfg[{k!r}] must be a positive number, got {v!r}")
        if self.wdtype not in WDTYPES:
            raise ValueError(f"cfg['wdtype'] must be one of {WDTYPES}, got {self.wdtype!r}")
        self._check_rope()

    def _check_rope(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"cfg['rope_type'] must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type == "default":
            given = [k for k in LLAMA3_ROPE_FIELDS if getattr(self, k) is not None]
            if given:
                raise ValueError(f"{_keys(given)} given but cfg['rope_type'] is 'default' (unscaled RoPE); "
                                 "they belong to rope_type 'llama3'")
            return
        missing = [k for k in LLAMA3_ROPE_FIELDS if getattr(self, k) is None]
        if missing:
            raise ValueError(f"cfg['rope_type'] = 'llama3' needs {_keys(missing)} (it needs all of "
                             f"{_keys(LLAMA3_ROPE_FIELDS)})")
        for k in LLAMA3_ROPE_FIELDS[:3]:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"cfg[{k!r}] must be a finite number, got {v!r}")
            object.__setattr__(self, k, float(v))       # 8 and 8.0 give the same tables; keep one spelling
        if not self.rope_factor >= 1.0:
            raise ValueError(f"cfg['rope_factor'] must be >= 1 (llama3 divides the low frequencies by it), "
                             f"got {self.rope_factor!r}")
        if not self.rope_low_freq_factor > 0:
            raise ValueError(f"cfg['rope_low_freq_factor'] must be > 0, got {self.rope_low_freq_factor!r}")
        if not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ValueError(f"cfg['rope_high_freq_factor'] = {self.rope_high_freq_factor!r} must be greater than "
                             f"cfg['rope_low_freq_factor'] = {self.rope_low_freq_factor!r} (llama3 interpolates "
                             "between the two wavelengths they set)")
        _check_pos_int("rope_original_max_pos", self.rope_original_max_pos)

    # ---- derived sizes -------------------------------------------------------------
    @property
    def group(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.n_q // self.n_kv

    @property
    def q_dim(self) -> int:
        return self.n_q * self.hd

    @property
    def kv_dim(self) -> int:
        return self.n_kv * self.hd

    def layer_weight_bytes(self) -> int:
        """bf16 bytes of one layer's weights (norm vectors included)."""
        d = self.d
        mats = self.q_dim * d + 2 * self.kv_dim * d + d * self.q_dim + 3 * self.ffn * d
        return 2 * (mats + 2 * d)

    def kv_bytes(self, n_keys: int) -> int:
        """bf16 bytes of K and V read by one layer's attention over ``n_keys`` keys (batch 1)."""
        return 2 * 2 * self.n_kv * n_keys * self.hd

    def bytes_per_step(self, pos: int) -> int:
        """HBM bytes one decode step at ``pos`` must move: weights + KV read, once each."""
        b = self.layers * (self.layer_weight_bytes() + self.kv_bytes(pos + 1))
        if self.vocab:
            b += self.vocab * self.d * 2 + 2 * self.d * 2   # lm_head streams; one embed row; final norm
        return b

    def spec_bytes_per_step(self, pf: int = 4096, ds: int = 32) -> int:
        """The seed spec's ``bytes_per_step``: matrices (no norm vectors) + KV of pf+ds keys."""
        d = self.d
        wb = (self.q_dim * d + 2 * self.kv_dim * d + d * self.q_dim + 3 * self.ffn * d) * 2
        return self.layers * (wb + 2 * self.n_kv * (pf + ds) * self.hd * 2)

    # ---- conversions ---------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("name")
        if not self.vocab:
            d.pop("vocab")
        if self.rope_type == "default":     # unscaled RoPE: the spec's cfg dict, as before
            d.pop("rope_type")
        for k in LLAMA3_ROPE_FIELDS:
            if d[k] is None:
                d.pop(k)
        return d

    @classmethod
    def from_dict(cls, cfg: dict, name: str = "custom") -> "ModelConfig":
        if isinstance(cfg, ModelConfig):
            return cfg
        if not isinstance(cfg, dict):
            raise TypeError(f"cfg must be a dict or ModelConfig, got {type(cfg).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"name"}
        unknown = set(cfg) - known
        if unknown:
            raise ValueError(f"cfg has unknown keys {sorted(unknown)}; known keys are {sorted(known)}")
        missing = {"layers", "d", "ffn", "n_q", "n_kv", "hd"} - set(cfg)
        if missing:
            raise ValueError(f"cfg is missing required keys {sorted(missing)}")
        return cls(**cfg, name=name)

    def with_layers(self, layers: int) -> "ModelConfig":
        return dataclasses.replace(self, layers=layers, name=f"{self.name}x{layers}")

    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def _p(name, **kw) -> ModelConfig:
    return ModelConfig(name=name, **kw)


#: the RoPE scaling of the Llama 3.1 / 3.2 checkpoints' config.json (rope_scaling), less the factor
_LLAMA3_ROPE = dict(rope_type="llama3", rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_original_max_pos=8192)


#: Shapes of real models (weights are random in tests and benchmarks) and small test configs.
PRESETS: dict[str, ModelConfig] = {
    # the seed spec's layer: one 70B-class decoder layer
    "llama70b-layer": _p("llama70b-layer", layers=1, d=8192, ffn=28672, n_q=64, n_kv=8, hd=128,
                         eps=1e-5, theta=500000.0),
    "llama70b-16": _p("llama70b-16", layers=16, d=8192, ffn=28672, n_q=64, n_kv=8, hd=128,
                      eps=1e-5, theta=500000.0),
    # the whole 70B model (80 layers, untied LM head): tensor parallel over two GPUs (bench/tp_bench.py)
    "llama3.1-70b": _p("llama3.1-70b", layers=80, d=8192, ffn=28672, n_q=64, n_kv=8, hd=128,
                       eps=1e-5, theta=500000.0, vocab=128256, **_LLAMA3_ROPE, rope_factor=8.0),
    "llama3.1-8b": _p("llama3.1-8b", layers=32, d=4096, ffn=14336, n_q=32, n_kv=8, hd=128,
                      eps=1e-5, theta=500000.0, vocab=128256, **_LLAMA3_ROPE, rope_factor=8.0),
    "llama3.2-1b": _p("llama3.2-1b", layers=16, d=2048, ffn=8192, n_q=32, n_kv=8, hd=64,
                      eps=1e-5, theta=500000.0, vocab=128256, **_LLAMA3_ROPE, rope_factor=32.0),
    # small configs for CPU tests (Triton interpreter and the tape VM)
    "tiny": _p("tiny", layers=1, d=64, ffn=128, n_q=4, n_kv=1, hd=16, theta=10000.0),        # GQA 4
    "tiny-gqa8": _p("tiny-gqa8", layers=1, d=96, ffn=224, n_q=8, n_kv=1, hd=16, theta=10000.0),  # GQA 8, not pow2
    "tiny-mha": _p("tiny-mha", layers=1, d=80, ffn=176, n_q=2, n_kv=2, hd=32, theta=10000.0),   # GQA 1, not pow2
    "small-gqa4": _p("small-gqa4", layers=1, d=192, ffn=448, n_q=8, n_kv=2, hd=32),            # not pow2
    "small-2layer": _p("small-2layer", layers=2, d=128, ffn=320, n_q=4, n_kv=2, hd=32),
}
