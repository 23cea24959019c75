"""``router_probe``: the device measures its own expert-activation probabilities over *all*
experts, also those it does not hold, so that FedMoE's sub-model search can use the device's
own p instead of one estimated from other devices (``fedmoe`` assignment with ``own_p``;
docs/methods/fedmoe.md "Own p").

FedMoE (Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of
Experts", arXiv:2408.11304, "Stage One") searches each device's sub-model from p[c,l,e], the
share of the device's tokens the router sends to expert e of layer l. Only a device holding the
full MoE can measure it by routing; the others hold the router rows of their own experts only.
This term gets every expert's router row from the cloud (tensor ``router_probe.rows``, float32
``(L, E, H)``: L MoE layers in ascending order, E experts, H hidden size; 4·L·E·H bytes, e.g.
161 KiB for 10 layers of 7 experts at H = 576) and, before training, runs the received sub-MoE
over the local validation split without gradients, scoring each real token's input to every MoE
layer against all E rows: p[l][e] = share of tokens whose top-k over the E logits includes e
(top-k counted, as ``activation_prob``, so each layer sums to k). The hidden states are the held
sub-MoE's, so layers after the first MoE layer are approximate for a device that holds few
experts. Nothing but p leaves the device (``Stats.extras``: ``router_probe.p.<layer>``, E values).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import ObjectiveTerm

ROWS = "router_probe.rows"
"""The extra tensor with every expert's router row, ``(L, E, H)`` float32."""


class RouterProbe(ObjectiveTerm):
    """Activation probabilities over every expert on the validation split (see the module).

    Params: ``top_k`` (1..E, the model's top-k). Reports nothing without validation samples.

    Raises:
        ValueError: ``router_probe.rows`` missing or not ``(L, E, H)``, or ``top_k`` out of range.
    """

    name = "router_probe"
    adds_loss = False

    def __init__(self, params: dict[str, Any], ctx):
        super().__init__(params, ctx)
        rows = ctx.tensors.get(ROWS)
        if rows is None or rows.dim() != 3:
            raise ValueError(f"objective 'router_probe' needs the tensor {ROWS!r} of shape (layers, experts, hidden)")
        self.rows = rows.float()
        self.top_k = int(self.param("top_k", lo=1, hi=rows.shape[1]))
        self._result: dict[str, list[float]] = {}

    @torch.no_grad()
    def before_training(self, model: Any) -> None:
        if not self.ctx.val_items:
            return
        from moe_model.models.moe import moe_blocks  # torch modules: not for a config check naming the term

        blocks = dict(sorted(moe_blocks(model.model).items()))
        if len(blocks) != self.rows.shape[0] or any(b.router.weight().shape[-1] != self.rows.shape[2]
                                                   for b in blocks.values()):
            hidden = next(iter(blocks.values())).router.weight().shape[-1] if blocks else None
            raise ValueError(f"{ROWS} has shape {tuple(self.rows.shape)}; this sub-MoE has {len(blocks)} MoE layers "
                             f"of hidden size {hidden}")
        seen: dict[int, torch.Tensor] = {}
        hooks = [b.register_forward_pre_hook(lambda m, args, layer=layer: seen.__setitem__(layer, args[0]))
                 for layer, b in blocks.items()]
        counts = torch.zeros(self.rows.shape[:2], dtype=torch.float64)
        tokens = 0
        was_training = model.training
        model.eval()
        try:
            size = self.ctx.train.batch_size
            for i in range(0, len(self.ctx.val_items), size):
                batch, _ = model.collate(self.ctx.val_items[i:i + size])
                seen.clear()
                model(batch)
                valid = model.model.token_mask(batch).reshape(-1)
                tokens += int(valid.sum())
                for j, layer in enumerate(blocks):
                    h = seen[layer].reshape(-1, self.rows.shape[2])[valid].float()
                    top = (h @ self.rows[j].T).topk(self.top_k, dim=-1).indices
                    counts[j] += torch.bincount(top.reshape(-1), minlength=self.rows.shape[1]).double()
        finally:
            for h in hooks:
                h.remove()
            model.train(was_training)
        if tokens:
            self._result = {f"p.{layer}": (counts[j] / tokens).tolist() for j, layer in enumerate(blocks)}

    def statistics(self) -> dict[str, list[float]]:
        return dict(self._result)
