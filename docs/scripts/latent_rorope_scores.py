"""RoRoPE leaves every attention score of SmolLM2-135M unchanged before any cut; FreqFold changes them by the
merged frequencies (issue 54). For every layer: the queries and keys the projections write on a held-out window,
the layer's RoRoPE mix (headkit.surgery.latent_fit.rotary_mixing, PCA on this window's own input moment), and the
largest score difference |s' − s| / max |s| between the original heads' rotated scores and the mixed slots' ones,
all slots rotary.

    PYTHONPATH=src python docs/scripts/latent_rorope_scores.py
"""

from __future__ import annotations

import torch

from headkit.recipes.compress import CompressSettings, latent_windows, load_teacher
from headkit.runs.models import smollm2_gguf_path
from headkit.surgery.latent_fit import rotary_mixing


def rotated_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, 2, P] (each pair's two coordinates), cos/sin [T, P] → rotated."""
    first, second = x[..., 0, :], x[..., 1, :]
    return torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-2)


def main() -> None:
    torch.set_num_threads(1)
    teacher = load_teacher(smollm2_gguf_path(), "float32")
    model = teacher.model
    _, held_out, _ = latent_windows(teacher, CompressSettings(window=256, eval_window=256, held_out_texts=1))
    tokens = held_out[:1, :128]
    layers = model.model.layers
    seen: dict[int, dict] = {i: {} for i in range(len(layers))}
    hooks = []
    for index, layer in enumerate(layers):
        attention = layer.self_attn
        hooks.append(
            attention.q_proj.register_forward_hook(lambda m, i, o, n=index: seen[n].update(q=o, x=i[0]))
        )
        hooks.append(attention.k_proj.register_forward_hook(lambda m, i, o, n=index: seen[n].update(k=o)))
        hooks.append(
            attention.register_forward_pre_hook(
                lambda m, a, k, n=index: seen[n].update(rotary=k["position_embeddings"]), with_kwargs=True
            )
        )
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    config = model.config
    heads, groups, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    half, per_group = head_dim // 2, heads // groups
    worst = {1: 0.0, 2: 0.0, 4: 0.0}
    overall = dict(worst)
    for index, layer in enumerate(layers):
        call = seen[index]
        length = tokens.shape[1]
        q = call["q"][0].double().reshape(length, heads, 2, half)
        k = call["k"][0].double().reshape(length, groups, 2, half)
        cos, sin = (t[0, :, :half].double() for t in call["rotary"])  # [T, P]
        x = call["x"][0].double()
        moment = x.T @ x / length
        rows = layer.self_attn.k_proj.weight.detach().double().reshape(groups, head_dim, -1)
        # The original scores: every head's rotated query against its group's rotated key.
        rq = rotated_pairs(q.permute(1, 0, 2, 3), cos, sin)  # [H, T, 2, P]
        rk = rotated_pairs(k.permute(1, 0, 2, 3), cos, sin).repeat_interleave(per_group, 0)
        original = torch.einsum("hmxp,hnxp->hmn", rq, rk)
        for fold in worst:
            mixing = rotary_mixing(rows, moment, head_dim, fold)  # every slot rotary: nothing cut
            mix = mixing.mix.reshape(groups, half, groups, half)
            virtual_k = torch.einsum("cpgf,tgxf->ctxp", mix, k)  # [G, T, 2, P]
            per_head = mix.repeat_interleave(per_group, dim=2).permute(2, 0, 1, 3)  # [H, G, P, P]
            lifted_q = torch.einsum("hcpf,htxf->hctxp", per_head, q.permute(1, 0, 2, 3))
            scores = torch.einsum(
                "hcmxp,cnxp->hmn", rotated_pairs(lifted_q, cos, sin), rotated_pairs(virtual_k, cos, sin)
            )
            error = float((scores - original).abs().max() / original.abs().max())
            worst[fold] = max(worst[fold], error)
            overall[fold] = max(overall[fold], float((scores - original).norm() / original.norm()))
    for fold, error in worst.items():
        print(
            f"rope_fold {fold}: over {len(layers)} layers, max of max |s' - s| / max |s| = {error:.3g}, "
            f"max of ||s' - s|| / ||s|| = {overall[fold]:.3g}"
        )


if __name__ == "__main__":
    main()
