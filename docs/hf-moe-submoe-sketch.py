"""Generic sub-MoE builder over transformers 5.x MoE modules (structure-based, no copied modelling code)."""
import copy, torch
from torch import nn

def _is_fused_experts(mod):
    E = getattr(mod, "num_experts", None)
    ps = list(mod.named_parameters(recurse=False))
    return isinstance(E, int) and ps and all(p.dim() == 3 and p.shape[0] == E for _, p in ps)

def _is_list_experts(mod):
    E = getattr(mod, "num_experts", None)
    return isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and isinstance(E, int) and len(mod) == E

def find_moe_blocks(model):
    """Yield (block_name, block, experts_name, experts, router_param_owner, router_param_name)."""
    out = []
    for name, mod in model.named_modules():
        ex = [(cn, c) for cn, c in mod.named_children() if _is_fused_experts(c) or _is_list_experts(c)]
        if len(ex) != 1: continue
        ecn, experts = ex[0]
        E = experts.num_experts
        router = None
        # prefer siblings that declare num_experts == E (all 5.x routers do); avoids matching shared-expert MLPs
        sib = sorted((x for x in mod.named_children() if x[1] is not experts), key=lambda x: getattr(x[1], "num_experts", None) != E)
        for cn, c in sib:
            for pn, p in c.named_parameters():
                if pn.endswith("weight") and p.dim() == 2 and p.shape[0] == E:
                    owner = c.get_submodule(pn.rsplit(".", 1)[0]) if "." in pn else c
                    router = (cn, c, owner, pn.rsplit(".", 1)[-1]); break
            if router: break
        if router: out.append(dict(name=name, block=mod, experts_name=ecn, experts=experts,
                                   router_name=router[0], router=router[1], router_owner=router[2]))
    return out

def slice_block(b, keep):
    """Restrict one MoE block to experts `keep` (list of original ids, any order)."""
    keep_t = torch.as_tensor(keep, dtype=torch.long)
    E, k = b["experts"].num_experts, len(keep)
    ex = b["experts"]
    if _is_fused_experts(ex):
        for pn, p in list(ex.named_parameters(recurse=False)):
            setattr(ex, pn, nn.Parameter(p.data[keep_t].clone(), requires_grad=p.requires_grad))
    elif isinstance(ex, nn.ModuleList):
        mods = [ex[i] for i in keep]; ex._modules.clear(); ex.extend(mods)
    else:  # ModuleDict keyed "<prefix><idx>" (Switch: expert_0..), forward indexes by f"expert_{i}"
        import re
        keys = list(ex.keys()); pre = re.match(r"(.*?)\d+$", keys[0]).group(1)
        mods = [ex[f"{pre}{i}"] for i in keep]
        for kk in keys: del ex[kk]
        for j, m in enumerate(mods): ex[f"{pre}{j}"] = m
    ro = b["router_owner"]
    for pn, p in list(ro.named_parameters(recurse=False)):   # weight (E,H), optional bias (E,)
        if p.shape[0] == E: setattr(ro, pn, nn.Parameter(p.data[keep_t].clone(), requires_grad=p.requires_grad))
    for bn, buf in list(ro.named_buffers(recurse=False)):     # e_score_correction_bias (E,)
        if buf.dim() >= 1 and buf.shape[0] == E: setattr(ro, bn, buf[keep_t].clone())
    if isinstance(ro, nn.Linear): ro.out_features = k
    for m in b["block"].modules():                               # block, router, experts
        if getattr(m, "num_experts", None) == E: m.num_experts = k
        if isinstance(getattr(m, "top_k", None), int): m.top_k = min(m.top_k, k)
        if getattr(m, "num_group", None) and k % m.num_group != 0 or (getattr(m, "num_group", None) and k // m.num_group < 2):
            m.num_group, m.topk_group = 1, 1     # group-limited routing cannot be kept for arbitrary subsets

def build_sub_model(full_model, keep_per_layer):
    """keep_per_layer: dict block_name -> list of expert ids (or a single list for all blocks)."""
    sub = copy.deepcopy(full_model)
    blocks = find_moe_blocks(sub)
    for b in blocks:
        keep = keep_per_layer[b["name"]] if isinstance(keep_per_layer, dict) else keep_per_layer
        slice_block(b, keep)
    ks = {len(keep_per_layer[b["name"]]) if isinstance(keep_per_layer, dict) else len(keep_per_layer) for b in blocks}
    if len(ks) == 1:   # model-level attributes used by aux loss (load_balancing_loss_func)
        k = ks.pop()
        if hasattr(sub, "num_experts"): sub.num_experts = k
        if hasattr(sub, "num_experts_per_tok"): sub.num_experts_per_tok = min(sub.num_experts_per_tok, k)
    return sub

def expert_shard(block, e):
    """Cut expert e out of a fused block -> dict of per-expert tensors (views)."""
    return {pn: p.data[e] for pn, p in block["experts"].named_parameters(recurse=False)}

def put_expert_shard(block, pos, shard):
    with torch.no_grad():
        for pn, t in shard.items(): getattr(block["experts"], pn)[pos].copy_(t)
