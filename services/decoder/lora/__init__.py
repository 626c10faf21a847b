"""Multi-LoRA runtime: adapter residency, the per-step LoRA context, and compute backends.

    slots.py        AdapterSlots: fixed device slots of adapter factors, leases by name, LRU,
                    waiters for a free slot (thread-safe; the engine and registry client use it)
    host_cache.py   HostAdapterCache: the host-memory tier that swap-ins copy from
    context.py      LoRAContext: per step, the model runner's LoRABatch and backend calls (no lock)
    layers.py       LoRALinear: the model's projections, each adding its correction via the context;
                    LoRATargets: weights a module applies itself (moe.py's router and experts)
    batch.py        LoRABatch: one step's token -> slot metadata (BGMV rows, SGMV segments)
    backend.py      LoRABackend: the compute interface (imports no implementation)
    registry.py     backend name -> factory (`--lora-backend` choices), make_backend
    torch_backend.py, cpu_backend.py, triton_backend.py: the implementations

The C BGMV kernel itself (lora_bgmv.c) is built with the attention kernel by kernels/native.py.
This package's own imports stop at the interface: importing it loads no backend implementation.
"""

from services.decoder.lora.batch import BASE_SLOT, LoRABatch
from services.decoder.lora.context import LoRAContext
from services.decoder.lora.host_cache import HostAdapterCache
from services.decoder.lora.layers import LoRALinear, LoRATargets, attach_context, expert_parts, target_shapes
from services.decoder.lora.slots import AdapterSlots, LoRAWeights

__all__ = ["BASE_SLOT", "AdapterSlots", "HostAdapterCache", "LoRABatch", "LoRAContext", "LoRATargets", "LoRALinear",
           "LoRAWeights", "attach_context", "expert_parts", "target_shapes"]
