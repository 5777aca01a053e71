"""Rotary position embedding: inverse frequencies per rope type, cos/sin tables built once per cache.

Supported `rope_type`s (the Hub's `rope_scaling` / `rope_parameters`): default, linear, yarn, llama3,
longrope (phimoe's).
Each formula follows transformers' `modeling_rope_utils` step for step, so the tables agree with the
reference to the last bit before the cos/sin. Tables use the `cat(freqs, freqs)` layout that
`rotate_half` expects and already carry YaRN's attention factor.

    rope = Rope(spec.rope, rotary_dim, spec.max_position_embeddings)
    rope.reserve(max_len)                      # once, when a cache is made
    cos, sin = rope.cos_sin(positions, dtype)  # [B, T, rot] each
    q = apply_rope(q, cos, sin)                # q [B, H, T, rot]

The fast form for heads laid out [B, T, heads, rot] (what a fused projection gives):
    cos, sin_signed = rope.cos_sin_signed(positions, dtype)   # [B, T, 1, rot]
    qk = apply_rope_rolled(qk, cos, sin_signed)                # bit for bit apply_rope
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from moekit.errors import SpecError
from moekit.spec.model_spec import RopeSpec
from moekit.spec.rope import yarn_mscale


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(theta: float, dim: int, params: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:  # DeepSeek-style: the ratio of the context lengths
        factor = max_positions / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where the high frequencies are kept as trained
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _llama3(theta: float, dim: int, params: dict) -> torch.Tensor:
    inv_freq = _default_inv_freq(theta, dim)
    factor = params["factor"]
    low_ff, high_ff = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(rope: RopeSpec, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32, attention_factor) for a rotary width `dim`."""
    params = rope.scaling_dict()
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return _default_inv_freq(rope.theta, dim), 1.0
    if kind == "linear":
        return _default_inv_freq(rope.theta, dim) / params["factor"], 1.0
    if kind == "yarn":
        return _yarn(rope.theta, dim, params, max_positions)
    if kind == "llama3":
        return _llama3(rope.theta, dim, params), 1.0
    if kind == "longrope":
        return _longrope(rope.theta, dim, params, max_positions)
    raise SpecError(f"rope_type {kind!r} is not supported (supported: default, linear, yarn, llama3, longrope)")


def _longrope(theta: float, dim: int, params: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """Phi's longrope as phimoe runs it in transformers 5.24: the short factors at every length (its
    rotary embedding recomputes them without a sequence length) and a cos/sin factor of
    short_mscale below original_max_position_embeddings, long_mscale beyond. One table serves only
    when the two are equal, as in Phi-3.5-MoE's config; otherwise it is refused, never approximated."""
    missing = [k for k in ("short_factor", "original_max_position_embeddings") if k not in params]
    if missing:
        raise SpecError(f"longrope needs {' and '.join(missing)} in rope_scaling")
    original = params["original_max_position_embeddings"]
    short, long = params.get("short_mscale"), params.get("long_mscale")
    if short is None or long is None:
        raise SpecError("longrope without short_mscale/long_mscale (phi3's form) is not supported by the engine")
    if short != long and max_positions > original:
        raise SpecError(f"longrope with short_mscale {short} != long_mscale {long} is not supported by the engine")
    factors = torch.tensor(params["short_factor"], dtype=torch.float32)
    inv_freq = 1.0 / (factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(short)


def rotary_dim(head_dim: int, rope: RopeSpec) -> int:
    return int(head_dim * rope.partial_rotary_factor)


class Rope(nn.Module):
    """cos/sin tables [P, rot] for positions 0..P-1, shared by every layer of a decoder."""

    def __init__(self, rope: RopeSpec, dim: int, max_position_embeddings: int):
        super().__init__()
        inv_freq, self.attention_scaling = inverse_frequencies(rope, dim, max_position_embeddings)
        self.dim = dim
        self.spec = rope
        self.fp32 = rope.fp32  # llama4 rotates in fp32 whatever the model dtype
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_table", torch.empty(0, dim), persistent=False)
        self.register_buffer("sin_table", torch.empty(0, dim), persistent=False)
        self.register_buffer("sin_signed_table", torch.empty(0, dim), persistent=False)
        # Within one decoder forward every layer asks for the same positions; `shared_for` holds
        # that lookup (keyed by the tensor object itself) for exactly that long.
        self._shared: tuple | None = None

    def reserve(self, positions: int) -> None:
        """Make the tables cover positions 0..positions-1 (a cache's length; the Hub max can be 128k)."""
        if self.cos_table.shape[0] >= positions:
            return
        pos = torch.arange(positions, device=self.inv_freq.device).float()
        freqs = pos[:, None] * self.inv_freq[None, :]  # [P, rot/2], same product as the reference
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = emb.cos() * self.attention_scaling
        self.sin_table = emb.sin() * self.attention_scaling
        half = self.dim // 2
        # rotate_half's minus moved onto the table: (-x2)·s and x2·(-s) are the same float.
        self.sin_signed_table = torch.cat((-self.sin_table[:, :half], self.sin_table[:, half:]), dim=-1)

    def _lookup(self, positions: torch.Tensor, dtype: torch.dtype, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        shared = self._shared
        if shared is not None and shared[0] is positions and shared[1] == dtype:
            found = shared[2].get(signed)
            if found is None:
                found = shared[2][signed] = self._lookup_now(positions, dtype, signed)
            return found
        return self._lookup_now(positions, dtype, signed)

    def _lookup_now(self, positions: torch.Tensor, dtype: torch.dtype, signed: bool):
        top = int(positions.max()) + 1 if positions.numel() else 0
        if top > self.cos_table.shape[0]:
            self.reserve(top)
        sin = self.sin_signed_table if signed else self.sin_table
        cos, sin = self.cos_table[positions].to(dtype), sin[positions].to(dtype)
        if signed:  # [B, T, 1, rot]: broadcast over the heads axis of [B, T, heads, rot]
            return cos.unsqueeze(2), sin.unsqueeze(2)
        return cos, sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] int64 → cos, sin [B, T, rot] in `dtype`."""
        return self._lookup(positions, dtype, signed=False)

    def cos_sin_signed(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] int64 → cos, sin with rotate_half's sign [B, T, 1, rot] (apply_rope_rolled's)."""
        return self._lookup(positions, dtype, signed=True)

    @contextmanager
    def shared_for(self, positions: torch.Tensor, dtype: torch.dtype):
        """Look cos/sin up once for a whole forward pass (positions must not change inside it)."""
        self._shared = (positions, dtype, {})
        try:
            yield
        finally:
            self._shared = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, rot], cos/sin [B, T, rot] → x rotated (the rotate_half layout)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def apply_rope_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, rot], cos/sin_signed [B, T, 1, rot] → x rotated, bit for bit `apply_rope`.

    roll by half swaps the halves in one op where rotate_half takes four (two slices, neg, cat).
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: pairs (x0, x1), (x2, x3) share a frequency; output de-interleaved as the
    reference's `apply_rotary_pos_emb_interleave` returns it."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def pairs_to_halves(rows: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """q or k projection rows [heads·hd, ...] for pair-wise rotation (llama4: (x0, x1), (x2, x3) turn
    as one complex number each) → the same rows with each head's even dims first, odd dims after.

    Rotating those halves (apply_rope_rolled) gives each pair exactly the complex product's real and
    imaginary parts, only stored apart; q and k are reordered alike, so every q·k is the same sum.
    """
    rest = rows.shape[1:]
    return rows.reshape(heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(heads * head_dim, *rest)


def apply_rope_complex(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """llama4's rotation as transformers writes it, the slow obvious form: x [B, T, heads, rot]
    read as rot/2 complex numbers of adjacent pairs, each times e^(i·pos·freq), in fp32, cast back."""
    freqs = positions[..., None].float() * inv_freq.float()  # [B, T, rot/2]
    turn = torch.polar(torch.ones_like(freqs), freqs)[:, :, None, :]
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * turn).flatten(3).type_as(x)
