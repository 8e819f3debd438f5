"""The adapter layer: one place that knows how each 🤗 architecture lays out its attention.

Surgery (collaborative heads, head gates, pruning) needs the same few things from every model: where each
layer's attention module is, its query/key/value/output projections as plain ``nn.Linear``-convention matrices,
its head counts, a way to write shrunk projections back, and a way to put a headkit module in place of the
attention module so that the model's own forward keeps working. An :class:`AttentionAdapter` answers those
questions for one architecture; the registry picks the adapter from ``model.config.model_type``.

Vocabulary
    site: one attention module that surgery may rewrite (:class:`AttentionSite`). A layer shared by several
        transformer layers (ALBERT) is one site listing all the layers that run it, so it is rewritten once.
    attention module: the module whose forward turns hidden states into per-head contexts (BERT's
        ``attention.self``, DistilBERT's ``attention``, GPT-2's ``attn``, LLaMA's ``self_attn``). It is the module
        a headkit replacement takes the place of.
    output projection: the module that consumes the concatenated heads [..., heads·head_dim] (BERT
        ``attention.output.dense``, DistilBERT ``out_lin``, GPT-2 ``c_proj``, LLaMA ``o_proj``). Hooking its input
        sees every head's output separately, which is what head gates need.
    epilogue: what some attention modules run after the heads inside their own forward (output projection,
        dropout, residual + LayerNorm); a replacement keeps those children under their original names.

Adding an architecture is one file in this package that subclasses :class:`AttentionAdapter` and decorates it
with :func:`register_adapter`; see ``API.md`` beside this file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.surgery.attention import mechanism_of
from headkit.surgery.families import supported_families


@dataclass
class ProjectionWeights:
    """Q/K/V/O parameters of one attention site in ``nn.Linear`` convention (weight [out, in]).

    Head h of the queries owns rows h·head_dim … (h+1)·head_dim of ``q_weight``; key/value head g likewise in
    ``k_weight`` / ``v_weight``; the output projection reads head h from columns h·head_dim … of ``o_weight``.
    Biases are None where the model has none. ``q_norm`` / ``k_norm`` are the weights of a normalisation the
    module applies to all query (key) heads together, one per row of ``q_weight`` (``k_weight``) — OLMo 2's
    q/k RMSNorm; None where the module has none (or normalises each head over its own width, which pruning
    leaves alone).
    """

    q_weight: torch.Tensor  # [num_heads·head_dim, hidden]
    k_weight: torch.Tensor  # [num_kv_heads·head_dim, hidden]
    v_weight: torch.Tensor  # [num_kv_heads·head_dim, hidden]
    o_weight: torch.Tensor  # [out_features, num_heads·head_dim]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [num_heads·head_dim]
    k_norm: torch.Tensor | None = None  # [num_kv_heads·head_dim]


@dataclass
class AttentionSite:
    """One rewritable attention module of a model.

    Attributes:
        index: position among the model's distinct sites, in forward order.
        layers: the transformer layers (forward order, from 0) that run this module; more than one when the
            module is shared (ALBERT).
        name: qualified name of the attention module in the model (``model.get_submodule(name)``).
        module: the attention module itself (the original, or a headkit replacement after surgery).
        output_projection_name / output_projection: the module consuming the concatenated heads.
        num_heads, num_kv_heads, head_dim: head geometry (num_kv_heads < num_heads under grouped-query attention).
        scale: the score scale the module applies (usually head_dim^-0.5; GPT-2 may divide by the layer index).
        causal: whether the module attends causally when the model passes no explicit mask.
        adapter: the adapter that produced the site.
    """

    index: int
    layers: tuple[int, ...]
    name: str
    module: nn.Module
    output_projection_name: str
    output_projection: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    causal: bool
    adapter: AttentionAdapter = field(repr=False)

    @property
    def is_headkit(self) -> bool:
        """True once surgery gave the module a headkit mechanism (linearized or collaborative heads, a layer
        pruned empty): its heads are no longer plain slices of the architecture's projections."""
        return mechanism_of(self.module) is not None


def mechanism_heads(module: nn.Module) -> tuple[int, int, int] | None:
    """(num_heads, num_kv_heads, head_dim) of a stock attention module whose headkit mechanism
    (``module.headkit_attention``) defines its heads in place of its projections' shapes — a mechanism with a
    ``head_geometry`` attribute, such as :class:`headkit.surgery.collaborative.CollaborativeHeads` — else None."""
    return getattr(mechanism_of(module), "head_geometry", None)


# id(signature) → (the signature, kept alive so its id stays its own; what _bind_quickly needs to know of it)
_SIGNATURES: dict[int, tuple[Any, ...]] = {}


def check_mask_is_tensor(attention_mask: Any, reader: str) -> None:
    """Refuse a mask that is not a tensor (an implementation's own mask object): `reader` cannot read it."""
    if not isinstance(attention_mask, torch.Tensor):
        raise HeadkitError(
            f"attention_mask of type {type(attention_mask).__name__} is not supported by {reader}; "
            "use attn_implementation='sdpa' or 'eager'"
        )


def checked_model_mask(attention_mask: Any, batch: int, q_len: int, kv_len: int) -> torch.Tensor | None:
    """The mask a 🤗 model hands its attention module, validated: None, a [B, Tk] key padding mask (returned as
    bool), or a 4D mask [B, 1|H, 1|Tq, Tk] (bool True = keep, or additive float; returned as it is).

    Depending on ``config._attn_implementation`` a 🤗 model hands its attention module None (nothing masked),
    a [B, Tk] key padding mask (flash-style, 1 = keep), a 4D bool mask (sdpa, True = keep) or a 4D additive float
    mask (eager, dtype-min for blocked); all of them mean the same thing.
    """
    if attention_mask is None:
        return None
    check_mask_is_tensor(attention_mask, "headkit attention modules")
    if attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (batch, kv_len):
            raise HeadkitError(
                f"a 2D attention_mask must be a key padding mask [batch, kv_len] = [{batch}, {kv_len}], "
                f"got {tuple(attention_mask.shape)}"
            )
        return attention_mask.bool()
    if attention_mask.dim() != 4 or attention_mask.shape[0] != batch or attention_mask.shape[-1] != kv_len:
        raise HeadkitError(
            f"attention_mask must have shape [batch, 1|heads, q_len|1, kv_len] = [{batch}, 1|H, {q_len}|1, {kv_len}], "
            f"got {tuple(attention_mask.shape)}"
        )
    if attention_mask.shape[2] not in (1, q_len):
        raise HeadkitError(
            f"attention_mask's query dimension must be 1 or {q_len}, got {attention_mask.shape[2]}"
        )
    return attention_mask


class AttentionAdapter:
    """How one architecture lays out its attention. Subclasses fill in the class attributes (paths relative to
    a transformer layer, attribute names on the attention module) and override what differs. The defaults
    describe the layout current 🤗 decoders share (LLaMA and its kin): ``layers[i].self_attn`` with
    ``q_proj`` / ``k_proj`` / ``v_proj``, running ``o_proj`` itself; an adapter declares where its architecture
    departs from it.

    Class attributes:
        name: registry key and what error messages call the architecture (e.g. "bert").
        model_types: ``config.model_type`` values this adapter handles; () (the default) means ``(name,)``.
        layers_path: path of the ``nn.ModuleList`` of transformer layers, relative to ``model.base_model``.
        attention_path: path of the attention module, relative to one layer.
        output_projection_path: path of the output projection, relative to one layer; "" (the default) means the
            attention module's own, ``attention_path`` + "." + ``epilogue_names[0]``.
        query_name, key_name, value_name: the projections' attribute names on the attention module.
        head_dim_attribute: the attention module's attribute holding head_dim.
        epilogue_names: attribute names (projection, dropout, residual LayerNorm; None where absent) of what the
            attention module runs after the heads in its own forward. () when the output projection lives outside
            the module (``output_projection_path`` then names it).
        rotary: the module applies rotary position embeddings to queries and keys (they are then no longer
            linear in the hidden states, which rules out the collaborative re-parametrisation).
        multi_head_only: the family's display name where its module computes exactly one key/value head per
            query head (no grouped-query attention: fused GPT-2, GPT-NeoX); None otherwise.
    """

    name: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    layers_path: ClassVar[str] = "layers"
    attention_path: ClassVar[str] = "self_attn"
    output_projection_path: ClassVar[str] = ""
    query_name: ClassVar[str] = "q_proj"
    key_name: ClassVar[str] = "k_proj"
    value_name: ClassVar[str] = "v_proj"
    head_dim_attribute: ClassVar[str] = "head_dim"
    epilogue_names: ClassVar[tuple[str | None, str | None, str | None] | tuple[()]] = ("o_proj", None, None)
    rotary: ClassVar[bool] = False
    multi_head_only: ClassVar[str | None] = None

    # -- detection ----------------------------------------------------------------------------------------------

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        """Whether this adapter handles `model` (by default: its ``config.model_type``)."""
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        return model_type in (cls.model_types or (cls.name,))

    # -- sites --------------------------------------------------------------------------------------------------

    def layers(self, model: nn.Module) -> list[nn.Module]:
        """The transformer layers in forward order (a shared layer appears once per use)."""
        return list(_base_model(model).get_submodule(self.layers_path))

    def sites(self, model: nn.Module) -> list[AttentionSite]:
        """Every distinct attention module, in forward order, each listed once with all the layers that run it."""
        names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
        by_module: dict[int, list[int]] = {}
        found: list[tuple[nn.Module, nn.Module]] = []
        for layer_index, layer in enumerate(self.layers(model)):
            module = layer.get_submodule(self.attention_path)
            if id(module) not in by_module:
                by_module[id(module)] = []
                found.append((module, layer.get_submodule(self._output_projection_path())))
            by_module[id(module)].append(layer_index)
        sites = []
        for index, (module, output_projection) in enumerate(found):
            if self.is_emptied(module):
                num_heads = num_kv_heads = 0
                head_dim = int(getattr(module, self.head_dim_attribute))
            else:
                num_heads, num_kv_heads, head_dim = mechanism_heads(module) or self.head_geometry(module)
            sites.append(
                AttentionSite(
                    index=index,
                    layers=tuple(by_module[id(module)]),
                    name=names[id(module)],
                    module=module,
                    output_projection_name=names[id(output_projection)],
                    output_projection=output_projection,
                    num_heads=num_heads,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    scale=float(self.scale(module)),
                    causal=bool(getattr(module, "is_causal", False)),
                    adapter=self,
                )
            )
        return sites

    def _output_projection_path(self) -> str:
        if self.output_projection_path or not self.epilogue_names:
            return self.output_projection_path
        return f"{self.attention_path}.{self.epilogue_names[0]}"

    def head_geometry(self, module: nn.Module) -> tuple[int, int, int]:
        """(num_heads, num_kv_heads, head_dim) of an attention module, from its weights' shapes so that it stays
        right after pruning."""
        head_dim = int(getattr(module, self.head_dim_attribute))
        query_rows = _linear_out_features(module.get_submodule(self.query_name))
        key_rows = _linear_out_features(module.get_submodule(self.key_name))
        return query_rows // head_dim, key_rows // head_dim, head_dim

    def scale(self, module: nn.Module) -> float:
        """The score scale the module applies (every supported 🤗 module stores it as ``scaling``)."""
        return float(module.scaling)

    # -- reading and writing projections ------------------------------------------------------------------------

    def read_projections(self, site: AttentionSite) -> ProjectionWeights:
        """The site's Q/K/V/O weights and biases in ``nn.Linear`` convention (detached tensors sharing storage
        with the model where the layout allows; clone before mutating)."""
        self._require_original(site, "read its projections")
        module = site.module
        q_weight, q_bias = linear_parameters(module.get_submodule(self.query_name))
        k_weight, k_bias = linear_parameters(module.get_submodule(self.key_name))
        v_weight, v_bias = linear_parameters(module.get_submodule(self.value_name))
        o_weight, o_bias = linear_parameters(site.output_projection)
        return ProjectionWeights(q_weight, k_weight, v_weight, o_weight, q_bias, k_bias, v_bias, o_bias)

    def write_projections(
        self, model: nn.Module, site: AttentionSite, weights: ProjectionWeights
    ) -> AttentionSite:
        """Rebuild the site's Q/K/V/O projections from `weights` (any head counts ≥ 1, e.g. after removing heads)
        and update the module's head-count attributes; returns the refreshed site.

        Head counts are read from the shapes: num_heads = rows(q)/head_dim, num_kv_heads = rows(k)/head_dim; the
        query heads must split evenly over the key/value heads. A layer left with no head at all cannot run the
        original forward: empty it instead (:meth:`write_empty`).
        """
        self._require_original(site, "write its projections")
        num_heads, num_kv_heads = check_projection_weights(
            weights, site, multi_head_only=self.multi_head_only
        )
        self.write_linears(model, site, weights)
        self.set_head_counts(site.module, num_heads, num_kv_heads, site.head_dim)
        return self.sites(model)[site.index]

    def write_linears(self, model: nn.Module, site: AttentionSite, weights: ProjectionWeights) -> None:
        """Put new projection modules holding `weights` in place (and whatever else the rows of the heads own, such
        as a norm across heads), with no check of the head counts and no head-count attribute set: the step
        :meth:`write_projections` and uneven grouped-query pruning share. A fused projection overrides this."""
        module = site.module
        replace_linear(module, self.query_name, weights.q_weight, weights.q_bias)
        replace_linear(module, self.key_name, weights.k_weight, weights.k_bias)
        replace_linear(module, self.value_name, weights.v_weight, weights.v_bias)
        replace_linear(model, site.output_projection_name, weights.o_weight, weights.o_bias)

    def is_emptied(self, module: nn.Module) -> bool:
        """Whether every head of the attention module was pruned (:meth:`write_empty`)."""
        return isinstance(getattr(module, self.query_name, None), NoHeads)

    def write_empty(self, model: nn.Module, site: AttentionSite) -> None:
        """Take every head out of the site's module, which stays the stock module: each projection becomes
        :class:`NoHeads` (one placeholder head of zeros per role it serves), the output projection
        :class:`BiasOnly`, and the module is told it has one head. The module's own forward then runs unchanged —
        its views, norms, rotary and cache call act on zeros — and adds the output projection's bias; the caller
        gives it a mechanism that skips the attention and stores nothing in the cache."""
        module = site.module
        names = [self.query_name, self.key_name, self.value_name]
        for name in dict.fromkeys(names):
            setattr(module, name, NoHeads(names.count(name) * site.head_dim))
        _, o_bias = linear_parameters(site.output_projection)
        parent_path, _, child = site.output_projection_name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        out_features = int(linear_parameters(site.output_projection)[0].shape[0])
        setattr(parent, child, BiasOnly(o_bias, in_features=site.head_dim, out_features=out_features))
        self.set_head_counts(module, 1, 1, site.head_dim)

    def set_gathered_head_counts(
        self, module: nn.Module, num_heads: int, num_stored_kv_heads: int, head_dim: int
    ) -> None:
        """Head-count attributes of a module whose key/value heads are gathered per query head after its cache
        (uneven grouped-query pruning): its projections hold `num_stored_kv_heads` key/value heads, its
        attention sees one per query head. By default the module is told it has as many key/value heads as
        query heads; an adapter whose forward splits a fused projection by the key/value count overrides this."""
        self.set_head_counts(module, num_heads, num_heads, head_dim)

    def stock_head_config(self, num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, int] | None:
        """Config fields that make the architecture's own class build attention with these head counts, or None
        when the config cannot say so (e.g. GPT-2 derives the head width from the hidden size): then a pruned
        model is reloaded by :func:`headkit.from_pretrained`, which replays the pruning."""
        return None

    def set_head_counts(self, module: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Update the attributes the module's forward reads its head counts from (architecture-specific)."""

    def set_fused_widths(self, module: nn.Module, widths: tuple[int, int, int]) -> None:
        """Make a module whose one fused projection (``query_name == key_name == value_name``) is split into
        queries, keys and values in its own forward split it into parts of these widths (collaborative heads:
        shared queries and keys of their own widths). Architecture-specific; refused by default."""
        raise HeadkitError(f"the {self.name} adapter cannot change how its fused projection is split")

    def _require_original(self, site: AttentionSite, action: str) -> None:
        if site.is_headkit:
            raise HeadkitError(
                f"site {site.name!r} already runs {type(mechanism_of(site.module)).__name__} (earlier headkit "
                f"surgery); cannot {action} with the {self.name} adapter"
            )


# -- registry ---------------------------------------------------------------------------------------------------

ADAPTERS: dict[str, type[AttentionAdapter]] = {}


def register_adapter(cls: type[AttentionAdapter]) -> type[AttentionAdapter]:
    """Class decorator: make `cls` available to :func:`get_adapter` under ``cls.name``."""
    if not cls.name:
        raise HeadkitError(f"{cls.__name__} must set a non-empty `name` to be registered")
    existing = ADAPTERS.get(cls.name)
    if existing is not None and existing is not cls:
        raise HeadkitError(f"an adapter named {cls.name!r} is already registered ({existing.__name__})")
    ADAPTERS[cls.name] = cls
    return cls


def supported_architectures() -> list[str]:
    """Names of the registered adapters."""
    return sorted(ADAPTERS)


def get_adapter(
    model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None
) -> AttentionAdapter:
    """The adapter for `model`: `adapter` itself (an instance, a class or a registered name), else the registered
    adapter whose :meth:`AttentionAdapter.matches` accepts the model."""
    if isinstance(adapter, AttentionAdapter):
        return adapter
    if isinstance(adapter, type) and issubclass(adapter, AttentionAdapter):
        return adapter()
    if isinstance(adapter, str):
        if adapter not in ADAPTERS:
            raise HeadkitError(
                f"unknown adapter {adapter!r}; registered adapters: {', '.join(supported_architectures())}"
            )
        return ADAPTERS[adapter]()
    if adapter is not None:
        raise HeadkitError(
            f"adapter must be an AttentionAdapter (class or instance), a registered name or None, got {adapter!r}"
        )
    matching = [cls for cls in ADAPTERS.values() if cls.matches(model)]
    if len(matching) == 1:
        return matching[0]()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not matching:
        raise HeadkitError(
            f"unsupported architecture {type(model).__name__} (model_type={model_type!r}); supported: "
            f"{', '.join(supported_architectures())}. To add one, write a subclass of "
            "headkit.surgery.adapters.AttentionAdapter decorated with @register_adapter in a new file of "
            "headkit/surgery/adapters/ (see API.md there), or pass an adapter explicitly; a decoder laid out "
            f"like LLaMA needs only an entry in headkit/surgery/families.py (decoder families: "
            f"{', '.join(supported_families())})"
        )
    raise HeadkitError(
        f"several adapters match {type(model).__name__} (model_type={model_type!r}): "
        f"{', '.join(cls.name for cls in matching)}; pass one explicitly"
    )


# -- helpers shared by the adapters -----------------------------------------------------------------------------


def linear_parameters(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [out, in], bias or None) of an ``nn.Linear`` or a GPT-2 style ``Conv1D`` (which stores [in, out]);
    a :class:`BiasOnly` projection's weight is zeros [out, in]."""
    if isinstance(module, BiasOnly):
        bias = None if module.bias is None else module.bias.detach()
        reference = module.bias if module.bias is not None else torch.empty(0)
        return reference.new_zeros(module.out_features, module.in_features), bias
    if isinstance(module, nn.Linear):
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    if _is_conv1d(module):
        return module.weight.detach().T, None if module.bias is None else module.bias.detach()
    raise HeadkitError(f"expected an nn.Linear or a transformers Conv1D, got {type(module).__name__}")


def new_linear(weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Module | None = None) -> nn.Module:
    """A fresh module computing x Wᵀ + b: an ``nn.Linear``, or a ``Conv1D`` when `like` is one."""
    weight = weight.detach()
    if like is not None and _is_conv1d(like):
        module = type(like)(weight.shape[0], weight.shape[1])
        module.to(device=weight.device, dtype=weight.dtype)
        if bias is None:
            raise HeadkitError("a Conv1D projection needs a bias")
        with torch.no_grad():
            module.weight.copy_(weight.T)
            module.bias.copy_(bias)
        return module
    linear = nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


class NoHeads(nn.Module):
    """The projection of an attention module whose heads were all pruned: `width` zero features whatever its
    input (a placeholder head per role: stock forwards view projections as [..., -1, head_dim], which cannot
    infer zero heads). No parameters, so the checkpoint holds none."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.new_zeros(*hidden_states.shape[:-1], self.width)

    def extra_repr(self) -> str:
        return f"width={self.width}"


class BiasOnly(nn.Module):
    """The output projection of an attention module with no heads: what projecting zero heads gives, its bias
    (zeros without one), broadcast over the input's leading dimensions."""

    def __init__(self, bias: torch.Tensor | None, *, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        shape = (*inputs.shape[:-1], self.out_features)
        if self.bias is None:
            return inputs.new_zeros(shape)
        return self.bias.to(inputs.dtype).expand(shape)

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, bias={self.bias is not None}"


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters of `model` (shared and tied tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def _linear_out_features(module: nn.Module) -> int:
    return int(linear_parameters(module)[0].shape[0])


def _base_model(model: nn.Module) -> nn.Module:
    return getattr(model, "base_model", model)


def replace_linear(root: nn.Module, path: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    parent_path, _, child_name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    old = getattr(parent, child_name)
    if (bias is None) != (linear_parameters(old)[1] is None):
        raise HeadkitError(f"{path}: the new bias must be given exactly when the module has one")
    setattr(parent, child_name, new_linear(weight.to(linear_parameters(old)[0].dtype), bias, like=old))


def check_projection_weights(
    weights: ProjectionWeights, site: AttentionSite, *, multi_head_only: str | None = None
) -> tuple[int, int]:
    """(query heads, key/value heads) of `weights`, checked against `site`'s geometry. `multi_head_only`: the
    family's name where its module has exactly one key/value head per query head (fused-qkv GPT-2, GPT-NeoX)."""
    head_dim = site.head_dim
    hidden = site.module.get_submodule(site.adapter.query_name)
    hidden_size = linear_parameters(hidden)[0].shape[1]
    shapes = {
        "q_weight": weights.q_weight.shape,
        "k_weight": weights.k_weight.shape,
        "v_weight": weights.v_weight.shape,
    }
    for name, shape in shapes.items():
        if len(shape) != 2 or shape[1] != hidden_size or shape[0] == 0 or shape[0] % head_dim:
            raise HeadkitError(
                f"{name} must have shape [heads·head_dim, hidden] with heads ≥ 1, head_dim={head_dim}, "
                f"hidden={hidden_size}; got {tuple(shape)}"
            )
    num_heads = weights.q_weight.shape[0] // head_dim
    num_kv_heads = weights.k_weight.shape[0] // head_dim
    if weights.v_weight.shape[0] != weights.k_weight.shape[0]:
        raise HeadkitError(
            f"v_weight must have as many rows as k_weight ({weights.k_weight.shape[0]}), got {weights.v_weight.shape[0]}"
        )
    if num_heads % num_kv_heads:
        raise HeadkitError(
            f"{num_heads} query heads do not split evenly over {num_kv_heads} key/value heads; grouped-query "
            "attention needs num_heads % num_kv_heads == 0"
        )
    if tuple(weights.o_weight.shape[1:]) != (num_heads * head_dim,):
        raise HeadkitError(
            f"o_weight must have shape [out, num_heads·head_dim] = [out, {num_heads * head_dim}], "
            f"got {tuple(weights.o_weight.shape)}"
        )
    for name, bias, rows in (
        ("q_bias", weights.q_bias, weights.q_weight.shape[0]),
        ("k_bias", weights.k_bias, weights.k_weight.shape[0]),
        ("v_bias", weights.v_bias, weights.v_weight.shape[0]),
        ("o_bias", weights.o_bias, weights.o_weight.shape[0]),
    ):
        if bias is not None and tuple(bias.shape) != (rows,):
            raise HeadkitError(f"{name} must have shape [{rows}], got {tuple(bias.shape)}")
    if multi_head_only is not None and num_kv_heads != num_heads:
        raise HeadkitError(
            f"{multi_head_only} has as many key/value heads as query heads: got {num_heads} and {num_kv_heads}"
        )
    return num_heads, num_kv_heads


_RECORDABLE_CLASSES: dict[tuple[type, type], type] = {}
