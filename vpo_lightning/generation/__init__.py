"""Generation: loading models and tokenizers, the rollout engines and their decode loop, adapter folders.

transformers, peft and vLLM live here; nothing here imports Lightning. docs/ARCHITECTURE.md lists the modules.
"""

from typing import Any

# A transformers causal LM, possibly wrapped by PEFT: its attributes (config, generate, get_base_model,
# disable_adapter, model.layers, ...) are duck-typed, which nn.Module's __getattr__ (-> Tensor | Module) cannot say.
HFModel = Any
