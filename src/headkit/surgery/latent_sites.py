"""The attention sites a latent conversion changes, on a model: refused where earlier surgery changed them or
where the mechanism cannot be absorbed (:func:`latent_sites`), and the latent mechanisms a model holds
(:func:`latent_mechanisms`) — the model side of :class:`~headkit.surgery.latent_config.LatentKVConfig`'s checks,
which imports this module only when it checks a model.
"""

from __future__ import annotations

from torch import nn

from headkit.errors import HeadkitError
from headkit.layers.base import KV_HEAD_INDEX
from headkit.surgery.adapters import AttentionAdapter, AttentionSite, get_adapter
from headkit.surgery.attention import HEAD_GATE, mechanism_of
from headkit.surgery.families import LATENT, get_family
from headkit.surgery.latent_heads import LatentKVHeads


def latent_sites(
    model: nn.Module, adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None
) -> tuple[AttentionAdapter, list[AttentionSite], int]:
    """The adapter, the attention sites to convert and the hidden width their key projections read, checked: the
    model's family, its attention modules (stock softmax, one layer of grouped-query attention each, no per-head
    k/q norm), no layer latent already."""
    check_not_latent(model)
    if adapter is None:
        get_family(model, LATENT)
    adapter = get_adapter(model, adapter)
    sites = check_latent_sites(model, adapter)
    hidden = adapter.read_projections(sites[0]).k_weight.shape[1]
    return adapter, sites, hidden


def check_not_latent(model: nn.Module) -> None:
    # Before the adapter reads the projections: a latent layer's are no longer nn.Linear.
    converted = [m.layer_idx for m in latent_mechanisms(model)]
    if converted:
        raise HeadkitError(f"the model's keys and values are already latent (layers {converted})")


def check_latent_sites(model: nn.Module, adapter: AttentionAdapter) -> list[AttentionSite]:
    sites = adapter.sites(model)
    if not sites:
        raise HeadkitError(f"the {adapter.name} adapter found no attention module in this model")
    for site in sites:
        mechanism = mechanism_of(site.module)
        if isinstance(mechanism, LatentKVHeads):
            raise HeadkitError(f"the model's keys and values are already latent ({site.name})")
        if mechanism is not None:
            raise HeadkitError(
                f"{site.name} already runs {type(mechanism).__name__} (earlier surgery: linearized or swapped); "
                "latent keys/values need the stock softmax attention"
            )
        if getattr(site.module, KV_HEAD_INDEX, None) is not None or getattr(site.module, HEAD_GATE, None):
            raise HeadkitError(
                f"{site.name} is pruned unevenly (a key/value head index) or gated: latent keys/values need "
                "every layer's stock key/value heads; prune uniformly (a stock architecture) instead"
            )
        if len(site.layers) != 1 or site.head_dim % 2 or site.num_heads % site.num_kv_heads:
            raise HeadkitError(
                f"{site.name} is not one layer of grouped-query attention with an even head_dim"
            )
        for name in ("k_norm", "q_norm"):
            if isinstance(getattr(site.module, name, None), nn.Module):
                raise HeadkitError(
                    f"{site.name} normalises each head's {name[0]} after the projection ({name}): the norm of "
                    "[k_rope ; K c] is not linear in the latent, so the key up-projection cannot be absorbed"
                )
    return sites


def latent_mechanisms(model: nn.Module) -> list[LatentKVHeads]:
    """The model's :class:`~headkit.surgery.latent_heads.LatentKVHeads`, in layer order."""
    found = {id(m): m for m in model.modules() if isinstance(m, LatentKVHeads)}
    return sorted(found.values(), key=lambda mechanism: mechanism.layer_idx)
