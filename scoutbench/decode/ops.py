"""The decode step's model work around attention (norms, the attention prologue, the output projection, the MLP),
in one of three forms, chosen once per engine:

- `cpu-kernel` (a CPU with the compiled library): `kernels/cpu_decode`, one call where HF makes ~45 torch ops and
  at the memory rate where torch's sgemv reads weights at half of it; sums within fp32 rounding of HF's.
- `fused` (CUDA, and a CPU without the library): few torch calls per layer, because on a GPU each call costs 5-20 us
  of host time and a decode step of thousands of them is launch-bound. One `F.rms_norm` per norm (HF's takes
  seven ops); RoPE as `x * cos + (x @ R) * sin` with R the signed permutation of HF's `rotate_half` (exact: R has
  one +-1 per column) and cos/sin read from a per-position table built once from the model's own rotary embedding
  (`index_select` by the device positions: graph-safe); decode rows as `[B, heads, D]` views with no transposes.
  Bit-identical to HF in fp32 on a CPU; in bf16 `F.rms_norm` rounds once where HF rounds after the float32 norm and
  again after the weight, within one bf16 ulp (docs/architecture.md, tests/models/test_decode_ops.py).
- `hf` (`SCOUTBENCH_DECODE_OPS=hf`, or `SCOUTBENCH_CPU_ATTENTION=torch` on a CPU): HF's own modules in HF's order, so
  that with the same attention the logits are bit-identical to `model(...)` (tests/engine/test_engine.py).

Hidden states are `[B, hidden]` rows (one new token per sequence); q `[B, Hq, D]`, k/v `[B, Hkv, D]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scoutbench.environment import DECODE_OPS_FORMS, value
from scoutbench.kernels import cpu_attention, cpu_decode, hf_forward

# HF's modules whose forward the fused and kernel forms reproduce: MLPs that are exactly `down_proj(act_fn(gate_proj(x))
# * up_proj(x))`, LlamaRMSNorm and its copies, and attentions whose prologue is q/k/v projections, optional q/k
# RMSNorms and rotate-half RoPE with the model's cos/sin
GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
ROPE_ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"})
# rope types whose cos/sin depend only on the position (a table serves them); dynamic ones rescale with the length
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
FORMS = DECODE_OPS_FORMS


def choose_form(device: torch.device) -> str:
    """The form a new engine on `device` uses (module docstring)."""
    forced = value("SCOUTBENCH_DECODE_OPS")
    if forced is not None:
        return forced
    if device.type == "cpu":
        if value(cpu_attention.ENV_BACKEND) == "torch":
            return "hf"
        return "cpu-kernel" if cpu_attention.library() is not None else "fused"
    return "fused"


def rotate_half_matrix(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """R with `x @ R == rotate_half(x) == cat(-x[..., D/2:], x[..., :D/2])` (exact: one +-1 per column)."""
    half = head_dim // 2
    eye = torch.eye(half, dtype=dtype, device=device)
    rotation = torch.zeros((head_dim, head_dim), dtype=dtype, device=device)
    rotation[half:, :half] = -eye
    rotation[:half, half:] = eye
    return rotation


class DecodeOps:
    """The model work of a decode step for one model, in one form (module docstring)."""

    def __init__(self, model: torch.nn.Module, form: str, max_len: int):
        self.model = model
        inner = model.model
        self.layers = list(inner.layers)
        config = model.config
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.rotary_emb = inner.rotary_emb
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # the fused form serves only the modules it reproduces; anything else runs as HF's module
        prologues = [self._fusable_prologue(layer.self_attn) for layer in self.layers]
        self.form = "hf" if form == "fused" and any(p is None for p in prologues) else form
        self._prologues = prologues
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.form == "fused":
            self._rotation = rotate_half_matrix(self.head_dim, self.dtype, self.device)
            if getattr(self.rotary_emb, "rope_type", "default") in STATIC_ROPE_TYPES:
                positions = torch.arange(max_len, device=self.device)[None, :]
                probe = torch.empty((1, 1), dtype=self.dtype, device=self.device)
                cos, sin = self.rotary_emb(probe, positions)  # [1, max_len, D]: HF's own values, row by row
                self._rope_table = (cos[0, :, None].contiguous(), sin[0, :, None].contiguous())

    # ------------------------------------------------------------------ the pieces of a layer
    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[B, 1, D]` at each sequence's position (`positions` `[B]` on the device)."""
        if self._rope_table is not None:
            cos, sin = self._rope_table
            return cos.index_select(0, positions), sin.index_select(0, positions)
        probe = torch.empty((1, 1), dtype=self.dtype, device=self.device)
        cos, sin = self.rotary_emb(probe, positions[:, None])
        if self.form == "cpu-kernel":  # the kernel reads [B, D] rows: made once per step, not per layer
            cos, sin = (cpu_attention.rows_of(t, t.shape[0], t.shape[-1])[:, None] for t in (cos, sin))
        return cos, sin

    def norm(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`module(x)` for an RMSNorm: one call in the fused form, the kernel's on a CPU."""
        if type(module).__name__ in RMS_NORMS:
            if self.form == "fused":
                return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
            if self.form == "cpu-kernel":
                return cpu_decode.rms_norm(module, x)
        return module(x)

    def linear(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`module(x)`; a plain `nn.Linear` through the kernel on a CPU, `F.linear` otherwise."""
        if type(module) is torch.nn.Linear:
            if self.form == "cpu-kernel":
                return cpu_decode.linear(x, module.weight, module.bias)
            return F.linear(x, module.weight, module.bias)
        return module(x)

    def prologue(self, layer: int, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[B, Hq, D]`, k and v `[B, Hkv, D]` of layer `layer` for the rows `normed` `[B, hidden]`, rotated."""
        q, k, v = self._prologue(layer, normed, cos, sin, with_kv=True)
        return q, k, v

    def query(self, layer: int, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s rotated query `[B, Hq, D]` for `normed` `[B, hidden]` (the layer-ahead prediction)."""
        return self._prologue(layer, normed, cos, sin, with_kv=False)[0]

    def residual_linear(self, residual: torch.Tensor, module: torch.nn.Module, o: torch.Tensor) -> torch.Tensor:
        """`residual + module(o)` for the attention output `o` `[B, Hq, D]`."""
        return residual + self.linear(module, o.reshape(o.shape[0], -1))

    def mlp_residual(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`x + mlp(post_attention_layernorm(x))`; a gated MLP as its forward computes it, through `linear`."""
        mlp, h = layer.mlp, self.norm(layer.post_attention_layernorm, x)
        if self.form != "hf" and type(mlp).__name__ in GATED_MLPS:
            h = self.linear(mlp.down_proj, mlp.act_fn(self.linear(mlp.gate_proj, h)) * self.linear(mlp.up_proj, h))
        else:
            h = mlp(h)
        return x + h

    # ------------------------------------------------------------------ the prologue's forms
    def _prologue(self, layer: int, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, with_kv: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if self.form == "cpu-kernel" and self._prologues[layer] is not None:
            return cpu_decode.attention_prologue(self._prologues[layer][0], normed[:, None], self.num_heads,
                                                 self.num_kv_heads, cos, sin, with_kv)
        if self.form == "fused":
            return self._fused_prologue(layer, normed, cos, sin, with_kv)
        return hf_forward.decode_prologue(self.layers[layer].self_attn, normed[:, None], cos, sin, with_kv)

    def _fused_prologue(self, layer: int, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, with_kv: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        attn, norms = self._prologues[layer]
        batch = normed.shape[0]
        q = F.linear(normed, attn.q_proj.weight, attn.q_proj.bias).view(batch, self.num_heads, self.head_dim)
        if norms is not None:
            q = F.rms_norm(q, (self.head_dim,), norms[0].weight, norms[0].variance_epsilon)
        q = self._rope(q, cos, sin)
        if not with_kv:
            return q, None, None
        k = F.linear(normed, attn.k_proj.weight, attn.k_proj.bias).view(batch, self.num_kv_heads, self.head_dim)
        if norms is not None:
            k = F.rms_norm(k, (self.head_dim,), norms[1].weight, norms[1].variance_epsilon)
        v = F.linear(normed, attn.v_proj.weight, attn.v_proj.bias).view(batch, self.num_kv_heads, self.head_dim)
        return q, self._rope(k, cos, sin), v

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """HF's `x * cos + rotate_half(x) * sin` in its order of roundings, rotate_half as a matmul with R."""
        return x * cos + (x @ self._rotation) * sin

    @staticmethod
    def _fusable_prologue(attn: torch.nn.Module
                          ) -> tuple[torch.nn.Module, tuple[torch.nn.Module, torch.nn.Module] | None] | None:
        """(attention, its q/k norms or None) for one of `ROPE_ATTENTIONS` with plain linears (and `RMS_NORMS` q/k
        norms of one eps), else None: the HF modules the fused and kernel prologues reproduce."""
        if type(attn).__name__ not in ROPE_ATTENTIONS:
            return None
        if any(type(p) is not torch.nn.Linear for p in (attn.q_proj, attn.k_proj, attn.v_proj)):
            return None
        if not hasattr(attn, "q_norm"):
            return attn, None
        q_norm, k_norm = attn.q_norm, attn.k_norm
        if not (type(q_norm).__name__ in RMS_NORMS and type(k_norm).__name__ in RMS_NORMS
                and q_norm.variance_epsilon == k_norm.variance_epsilon):
            return None
        return attn, (q_norm, k_norm)

