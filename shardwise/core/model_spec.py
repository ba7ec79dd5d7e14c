"""The shape of a decoder-only transformer, as the planner needs it.

:meth:`ModelSpec.from_params` derives a GPT-like shape from a parameter count
(``Ψ ≈ 12·L·h² + V·h`` with a 4x MLP), picking the hidden size from an
aspect ratio ``h / L`` that grows with the model as in the GPT-3 family
(64 below 1B, 80 up to 5B, 128 above). It reproduces GPT-3 Small (12 x 768),
XL (24 x 2048), 6.7B (32 x 4096) and 175B (96 x 12288).
:meth:`ModelSpec.from_hf_config` reads the config of any decoder-only Hugging Face model, dense or
Mixture-of-Experts, and counts its parameters (:mod:`.hf_config`; ``counted_exactly`` says whether the
config told everything). A Mixture-of-Experts spec also carries its routed experts
(``num_experts``, ``experts_per_token``, ``expert_params``, ``moe_layers``), which the planner
splits over expert-parallel ranks. Frameworks are never
imported: :meth:`~ModelSpec.from_torch_module` and
:meth:`~ModelSpec.from_keras_model` only call methods of the object they get.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .errors import ConfigError
from .hardware import Quantity, parse_count
from .hf_config import hf_model_fields

__all__ = ["ModelSpec"]

_GPT2_VOCAB = 50257


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _default_heads(hidden: int) -> int:
    """Heads of width 128 for wide models (h >= 4096), else 64; at least 1."""
    width = 128 if hidden >= 4096 and hidden % 128 == 0 else 64
    return max(1, hidden // width) if hidden % width == 0 else 1


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A transformer language model: its size and the shape that drives activations."""

    num_params: int
    """Trainable parameters Ψ, embeddings included."""
    num_layers: int
    """Transformer blocks L."""
    hidden_size: int
    """Model width h."""
    seq_len: int = 2048
    """Tokens per training sequence s."""
    vocab_size: int = _GPT2_VOCAB
    """Vocabulary size V (the output logits are ``s x V`` per sequence)."""
    num_heads: Optional[int] = None
    """Attention heads a; ``None`` picks ``h / 128`` (``h / 64`` below h = 4096)."""
    ffn_multiplier: float = 4.0
    """MLP width as a multiple of ``hidden_size``; for a Mixture of Experts, the dense MLP width a token passes
    through besides its routed experts (shared experts, dense layers), averaged over the blocks."""
    num_kv_heads: Optional[int] = None
    """Key/value heads (grouped-query attention); ``None`` means ``num_heads``."""
    mlp_matrices: int = 2
    """Weight matrices of the MLP: 2 (up, down) or 3 for a gated MLP (gate, up, down, as Llama's)."""
    saved_activations: Optional[tuple[float, float]] = None
    """Activation elements one block keeps for backward per token and hidden unit, as
    ``(replicated, split by tensor parallelism)``; ``None`` uses Korthikanti et al.'s Megatron count."""
    tied_embeddings: bool = True
    """Whether the LM head shares the token table's weight (one ``V x h`` matrix) or has its own."""
    num_experts: int = 0
    """Routed experts per Mixture-of-Experts layer; 0 for a dense model."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k); 0 for a dense model."""
    expert_params: int = 0
    """Parameters of the routed experts of all MoE layers (part of ``num_params``; shared experts,
    routers and dense layers are not in it)."""
    moe_layers: int = 0
    """Blocks whose MLP is a Mixture of Experts (0 for a dense model; the others are dense)."""
    counted_exactly: bool = True
    """Whether ``num_params`` is the exact count: ``False`` when it was estimated, or when a Hugging Face
    config left something out (a model type whose norms, biases or gate shardwise does not know)."""

    def __post_init__(self) -> None:
        for name in ("num_params", "num_layers", "hidden_size", "seq_len", "vocab_size"):
            _positive(getattr(self, name), name)
        if self.num_heads is None:
            object.__setattr__(self, "num_heads", _default_heads(self.hidden_size))
        _positive(self.num_heads, "num_heads")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by "
                              f"num_heads {self.num_heads}")
        if isinstance(self.ffn_multiplier, bool) or not isinstance(self.ffn_multiplier, (int, float)) \
                or not (self.ffn_multiplier > 0 or self.ffn_multiplier == 0 and self.num_experts):
            raise ConfigError(f"ffn_multiplier must be a positive number (0 only for a Mixture of Experts whose "
                              f"blocks have no dense MLP), got {self.ffn_multiplier!r}")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _positive(self.num_kv_heads, "num_kv_heads")
        if self.heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if isinstance(self.mlp_matrices, bool) or not isinstance(self.mlp_matrices, int) \
                or self.mlp_matrices not in (2, 3):
            raise ConfigError(f"mlp_matrices must be 2 (up, down) or 3 (gated: gate, up, down), "
                              f"got {self.mlp_matrices!r}")
        if not isinstance(self.tied_embeddings, bool):
            raise ConfigError(f"tied_embeddings must be true or false, got {self.tied_embeddings!r}")
        if not isinstance(self.counted_exactly, bool):
            raise ConfigError(f"counted_exactly must be true or false, got {self.counted_exactly!r}")
        self._check_experts()
        if self.saved_activations is not None:
            saved = tuple(self.saved_activations)
            if len(saved) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
                                      for v in saved):
                raise ConfigError(f"saved_activations must be two non-negative numbers, got "
                                  f"{self.saved_activations!r}")
            object.__setattr__(self, "saved_activations", (float(saved[0]), float(saved[1])))

    def _check_experts(self) -> None:
        for name in ("num_experts", "experts_per_token", "expert_params", "moe_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        e, k, ex, moe = self.num_experts, self.experts_per_token, self.expert_params, self.moe_layers
        if e == 0:
            if k or ex or moe:
                raise ConfigError(f"experts_per_token={k}, expert_params={ex} and moe_layers={moe} describe "
                                  "Mixture-of-Experts layers, but num_experts is 0 (a dense model)")
            return
        if moe == 0:
            object.__setattr__(self, "moe_layers", self.num_layers)
            moe = self.num_layers
        if not 1 <= k <= e:
            raise ConfigError(f"experts_per_token must be between 1 and num_experts={e}, got {k}")
        if moe > self.num_layers:
            raise ConfigError(f"moe_layers={moe} exceeds the model's {self.num_layers} layers")
        if not 0 < ex < self.num_params:
            raise ConfigError(f"expert_params must be between 1 and num_params - 1 = {self.num_params - 1} "
                              f"(the experts are part of the model), got {ex}")
        if ex % (e * moe):
            raise ConfigError(f"expert_params={ex} is not {moe} MoE layers x {e} experts of equal size "
                              f"(not divisible by {e * moe})")

    @property
    def is_moe(self) -> bool:
        """Whether the model has Mixture-of-Experts layers."""
        return self.num_experts > 0

    @property
    def params_per_expert(self) -> int:
        """Parameters of one routed expert of one layer (0 for a dense model)."""
        return self.expert_params // (self.num_experts * self.moe_layers) if self.is_moe else 0

    @property
    def expert_layer_params(self) -> int:
        """Parameters of the routed experts of one MoE layer (0 for a dense model)."""
        return self.expert_params // self.moe_layers if self.is_moe else 0

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: the dense part and ``experts_per_token`` experts per MoE layer."""
        if not self.is_moe:
            return self.num_params
        return self.num_params - self.expert_params + self.expert_params * self.experts_per_token // self.num_experts

    @property
    def heads(self) -> int:
        """``num_heads`` as an ``int`` (always set after construction)."""
        return int(self.num_heads or 1)

    @property
    def layer_params(self) -> int:
        """Weights of one block: attention ``2h² + 2h·kv`` (q, out; k, v) plus MLP ``mlp_matrices·ffn·h²``.

        ``(4 + 2·ffn) h²`` for the default multi-head attention and plain MLP; biases and norms are left out.
        A Mixture-of-Experts block's routed experts are not in it (:attr:`expert_layer_params`).
        """
        h = self.hidden_size
        kv_width = h * int(self.num_kv_heads or self.heads) // self.heads
        return 2 * h * h + 2 * h * kv_width + round(self.mlp_matrices * self.ffn_multiplier * h * h)

    @property
    def vocab_params(self) -> int:
        """Weights of the token table and the LM head: ``V·h``, twice when the head is not tied."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @classmethod
    def from_params(cls, num_params: Quantity, *, seq_len: int = 2048, vocab_size: int = _GPT2_VOCAB,
                    num_layers: Optional[int] = None, hidden_size: Optional[int] = None,
                    num_heads: Optional[int] = None, ffn_multiplier: float = 4.0) -> "ModelSpec":
        """A plausible GPT-like shape for ``num_params`` (``"30B"``, ``1.3e9``); given dims are kept."""
        psi = parse_count(num_params, "num_params")
        _positive(psi, "num_params")
        per_h2 = 4 + 2 * ffn_multiplier  # layer params / h^2
        if hidden_size is None:
            if num_layers is not None:  # solve per_h2·L·h² + V·h = Ψ for h
                lay = _positive(num_layers, "num_layers")
                disc = vocab_size ** 2 + 4 * per_h2 * lay * psi
                raw = (-vocab_size + disc ** 0.5) / (2 * per_h2 * lay)
            else:  # h = r·L  =>  per_h2·h³/r + V·h ≈ Ψ; the V·h term is refined below
                ratio = 128 if psi >= 5e9 else 80 if psi >= 1e9 else 64
                raw = (psi * ratio / per_h2) ** (1 / 3)
            grain = 1024 if raw >= 4096 else 256 if raw >= 512 else 64
            hidden_size = max(grain, grain * round(raw / grain))
        _positive(hidden_size, "hidden_size")
        if num_layers is None:
            body = psi - vocab_size * hidden_size
            num_layers = max(1, round(body / (per_h2 * hidden_size ** 2)))
        return cls(num_params=psi, num_layers=num_layers, hidden_size=hidden_size, seq_len=seq_len,
                   vocab_size=vocab_size, num_heads=num_heads, ffn_multiplier=ffn_multiplier)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, seq_len: Optional[int] = None) -> "ModelSpec":
        """The spec of any decoder-only Hugging Face config dict, dense or Mixture-of-Experts.

        ``seq_len`` defaults to the config's context length (``n_positions`` /
        ``max_position_embeddings``). The parameter count is exact for the known families
        (``counted_exactly``); an encoder or a config without a width or depth raises
        :class:`ConfigError`.
        """
        fields = hf_model_fields(config)
        if seq_len is not None:
            fields["seq_len"] = seq_len
        return cls(**fields)

    @classmethod
    def from_torch_module(cls, module: Any, **shape: Any) -> "ModelSpec":
        """Count ``module.parameters()`` (shared tensors once); shape from ``module.config`` or ``shape``.

        A Hugging Face model's config gives the whole shape, experts included (:meth:`from_hf_config`),
        with the counted total as ``num_params`` (exact, whatever the config could tell).
        """
        seen: set[int] = set()
        total = 0
        for p in module.parameters():
            if id(p) not in seen and getattr(p, "requires_grad", True):
                seen.add(id(p))
                total += int(p.numel())
        config = getattr(module, "config", None)
        to_dict = getattr(config, "to_dict", None)
        if callable(to_dict) and total > 0:
            try:
                fields = hf_model_fields(to_dict())
            except (ConfigError, TypeError, ValueError):
                fields = None
            if fields is not None and fields["expert_params"] < total:
                fields.update(num_params=total, counted_exactly=True)
                if shape.get("seq_len") is not None:
                    fields["seq_len"] = shape["seq_len"]
                return cls(**fields)
        return cls._counted(total, config, shape, "torch module")

    @classmethod
    def from_keras_model(cls, model: Any, **shape: Any) -> "ModelSpec":
        """Count ``model.count_params()``; shape keyword arguments as in :meth:`from_params`."""
        return cls._counted(int(model.count_params()), None, shape, "keras model")

    @classmethod
    def _counted(cls, total: int, config: Any, shape: dict[str, Any], what: str) -> "ModelSpec":
        if total < 1:
            raise ConfigError(f"the {what} has no parameters")
        if config is not None:  # Hugging Face style configs, duck-typed
            for key, names in (("num_layers", ("num_hidden_layers", "n_layer")),
                               ("hidden_size", ("hidden_size", "n_embd")),
                               ("num_heads", ("num_attention_heads", "n_head")),
                               ("vocab_size", ("vocab_size",))):
                found = next((getattr(config, n) for n in names
                              if isinstance(getattr(config, n, None), int)), None)
                if found is not None:
                    shape.setdefault(key, found)
        return cls.from_params(total, **shape)
