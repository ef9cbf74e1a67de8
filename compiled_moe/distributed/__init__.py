"""Expert parallelism on torch.distributed: dispatch and combine across an expert-parallel
process group, and the experts block over it with exchanges overlapped with expert GEMMs.

Imported on demand (``import compiled_moe`` does not import torch.distributed's pieces):

    from compiled_moe.distributed import ep_dispatch, ep_combine, ep_moe_experts

``compiled_moe.moe_experts(..., ep_group=g)`` and ``compiled_moe.MoEExperts(..., ep_group=g)``
are the usual entry points; docs/expert_parallel.md is the guide.
"""

from compiled_moe.distributed.dispatch import (EPDispatch, ExchangePlan, capacity_rows,
                                               ep_combine, ep_dispatch, plan_exchange)
from compiled_moe.distributed.exchange import exchange
from compiled_moe.distributed.experts import ep_moe_experts

__all__ = ["EPDispatch", "ExchangePlan", "capacity_rows", "ep_combine", "ep_dispatch",
           "ep_moe_experts", "exchange", "plan_exchange"]
